"""Callbacks: the dispatch (`CallbackList`), the config form (`CallbackConfig`) as users
write it in YAML / --set, and (pending the trainer wiring) the events of a real run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ext_callbacks import DuckTyped, EventLog
from pydantic import BaseModel, ConfigDict
from regression import Regression

from gangtrain.app.cli import load_config
from gangtrain.app.config.callbacks import CallbackConfig, build_callbacks
from gangtrain.app.config.import_path import import_object
from trainer.errors import UserError
from trainer.observe.callbacks import Callback, CallbackError, CallbackList, implemented_events
from units import EvalUnit, MetricBag


class FakeTrainer:
    def __init__(self, step_nr: int) -> None:
        self.step_nr = step_nr


# --- dispatch ----------------------------------------------------------------------------


def test_only_implemented_events_are_called_in_order():
    calls = []

    class First(Callback):
        def on_step_end(self, trainer):
            calls.append(("first", trainer.step_nr))

    class Second(Callback):
        def on_step_end(self, trainer):
            calls.append(("second", trainer.step_nr))

        def on_validation_end(self, trainer, scores):
            calls.append(("second/valid", scores["valid/loss"]))

    duck = DuckTyped()
    callbacks = CallbackList([First(), Callback(), Second(), duck])
    assert len(callbacks) == 4
    assert callbacks.has("on_step_end") and callbacks.has("on_validation_end")
    assert not callbacks.has("on_train_start") and not callbacks.has("on_checkpoint_saved")
    assert implemented_events(Second) == ["on_step_end", "on_validation_end"]
    assert implemented_events(Callback()) == []

    callbacks.on_train_start(FakeTrainer(0))  # nobody implements it: nothing happens
    callbacks.on_step_end(FakeTrainer(3))
    callbacks.on_validation_end(FakeTrainer(3), {"valid/loss": 1.5})
    assert calls == [("first", 3), ("second", 3), ("second/valid", 1.5)]
    assert duck.steps == [3]


def test_no_callbacks_is_empty_and_free():
    callbacks = CallbackList()
    assert not callbacks
    assert not any(callbacks.has(event) for event in
                   ("on_train_start", "on_step_end", "on_validation_end",
                    "on_checkpoint_saved", "on_train_end"))
    with pytest.raises(ValueError, match="unknown callback event 'on_step'"):
        callbacks.has("on_step")


def test_an_exception_names_the_callback_the_event_and_the_step():
    callbacks = CallbackList([EventLog(fail_at_step=7)])
    callbacks.on_step_end(FakeTrainer(6))
    with pytest.raises(CallbackError) as info:
        callbacks.on_step_end(FakeTrainer(7))
    assert str(info.value) == "callback EventLog.on_step_end at step 7: ValueError: boom at 7"
    assert isinstance(info.value.__cause__, ValueError)  # the traceback of the user's code


def test_a_user_error_stays_a_user_error():
    class Strict(Callback):
        def on_checkpoint_saved(self, trainer, step_nr, path):
            raise UserError(f"no space left for {path.name}")

    with pytest.raises(UserError, match=r"^callback Strict.on_checkpoint_saved at step 20: "
                                        r"UserError: no space left for step_20$"):
        CallbackList([Strict()]).on_checkpoint_saved(FakeTrainer(21), 20, Path("ck/step_20"))


def test_an_object_with_no_event_is_refused():
    with pytest.raises(TypeError, match="int is not a callback"):
        CallbackList([3])


# --- config ------------------------------------------------------------------------------


class AppConfig(BaseModel):
    """Stands in for a recipe config whose trainer section has `callbacks`."""

    model_config = ConfigDict(extra="forbid")
    callbacks: list[CallbackConfig] = []


def load(*overrides: str) -> AppConfig:
    return load_config(AppConfig, {}, overrides=list(overrides))


def test_config_builds_callbacks_with_their_keyword_arguments():
    config = load("callbacks=[{name: 'ext_callbacks:EventLog', tag: run1, fail_at_step: 5},"
                  " ext_callbacks:DuckTyped, 'ext_callbacks:make_duck']")
    assert config.callbacks[0].kwargs == {"tag": "run1", "fail_at_step": 5}
    built = build_callbacks(config.callbacks)
    assert [type(c).__name__ for c in built] == ["EventLog", "DuckTyped", "DuckTyped"]
    assert built[0].tag == "run1" and built[0].fail_at_step == 5
    assert build_callbacks(None) == []
    # It round-trips through the dumped config (config.yaml, --dump-config).
    assert AppConfig.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nowhere_module:Cb",
         "config 'callbacks.0' = 'nowhere_module:Cb': Value error, cannot import "
         "callback 'nowhere_module:Cb': ModuleNotFoundError: No module named 'nowhere_module'"),
        ("broken_module:Cb",
         "cannot import callback 'broken_module:Cb': RuntimeError: broken on purpose"),
        ("ext_callbacks:Missing",
         "cannot import callback 'ext_callbacks:Missing': 'ext_callbacks' has no attribute "
         "'Missing'"),
        ("ext_callbacks.EventLog", "callback path 'ext_callbacks.EventLog' must look like "
                                   "'package.module:name'"),
        ("ext_callbacks:NotACallback", "callback 'ext_callbacks:NotACallback' is not a "
                                       "callback: subclass trainer.Callback or define one of"),
        ("ext_callbacks:NOT_CALLABLE", "callback 'ext_callbacks:NOT_CALLABLE' is a int, "
                                       "not a class"),
        ("{name: 'ext_callbacks:EventLog', tagg: x}",
         "callback 'ext_callbacks:EventLog': got an unexpected keyword argument 'tagg'"),
    ],
)
def test_config_mistakes_name_the_field_and_the_path(value, message):
    with pytest.raises(UserError) as info:
        load(f"callbacks=[{value}]")
    text = str(info.value)
    assert "config 'callbacks.0'" in text
    assert message in text
    assert "Traceback" not in text


def test_a_factory_declaring_something_else_is_refused_before_it_is_called():
    with pytest.raises(UserError, match="callback 'ext_callbacks:make_nothing' is not a "
                                        "callback: subclass trainer.Callback"):
        load("callbacks=[ext_callbacks:make_nothing]")


def test_a_constructor_error_names_the_path():
    config = load("callbacks=[{name: 'ext_callbacks:EveryN', every: 0}]")  # binds; bad value
    with pytest.raises(UserError, match="^callback 'ext_callbacks:EveryN' could not be built: "
                                        "ValueError: every must be >= 1, got 0$"):
        build_callbacks(config.callbacks)


def test_import_object_reaches_nested_attributes():
    assert import_object("trainer.observe.callbacks:Callback.on_step_end", "thing") is \
        Callback.on_step_end
    with pytest.raises(ValueError, match="^cannot import thing 'trainer.observe.callbacks:Callback.nope': "
                                         "'trainer.observe.callbacks:Callback' has no attribute 'nope'$"):
        import_object("trainer.observe.callbacks:Callback.nope", "thing")
    with pytest.raises(ValueError, match="thing path ':x' must look like"):
        import_object(":x", "thing")


# --- in a real run (needs the trainer's wiring) ----------------------------------------------




class RegressionEval(EvalUnit):
    metric_names = ("loss",)

    def __init__(self, model):
        self._model = model

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        metrics.update_total("loss", F.mse_loss(self._model(x).squeeze(-1), y,
                                                reduction="sum"), y.numel())


def _regression(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(64, 3)
    y = x @ torch.tensor([1.0, -1.0, 0.5])
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]
    model = torch.nn.Linear(3, 1)
    return model, batches


def test_a_run_calls_every_event_in_order(tmp_path):
    from trainer import Trainer

    model, batches = _regression()
    log = EventLog()
    result = Trainer(
        Regression(model), batches, torch.optim.SGD(model.parameters(), lr=0.05),
        output_dir=tmp_path, max_num_steps=6, validate_every_n_steps=3,
        checkpoint_every_n_steps=3, score_metric="valid/loss",
        valid_units=[RegressionEval(model)], valid_data_readers=[batches[:2]],
        progress=False, recorders=[], callbacks=[log],
    ).run()
    kinds = [event[0] for event in log.events]
    assert kinds == ["train_start", "step_end", "step_end", "step_end", "validation_end",
                     "checkpoint_saved", "step_end", "step_end", "step_end", "validation_end",
                     "checkpoint_saved", "train_end"]
    assert [e[1] for e in log.events if e[0] == "step_end"] == [1, 2, 3, 4, 5, 6]
    valid = [e for e in log.events if e[0] == "validation_end"]
    assert [e[1] for e in valid] == [3, 6]
    assert dict(result.score_history) == {3: valid[0][2]["valid/loss"],
                                          6: valid[1][2]["valid/loss"]}
    saved = [e for e in log.events if e[0] == "checkpoint_saved"]
    assert [(e[1], e[2], e[3]) for e in saved] == [
        (3, tmp_path / "checkpoints" / "step_3", True),
        (6, tmp_path / "checkpoints" / "step_6", True),
    ]
    assert log.events[-1] == ("train_end", 6)


def test_a_failing_callback_stops_the_run_with_a_clear_error(tmp_path):
    from trainer import Trainer

    model, batches = _regression()
    with pytest.raises(CallbackError, match="callback EventLog.on_step_end at step 4: "
                                            "ValueError: boom at 4"):
        Trainer(Regression(model), batches, torch.optim.SGD(model.parameters(), lr=0.05),
                output_dir=tmp_path, max_num_steps=6, progress=False, recorders=[],
                callbacks=[EventLog(fail_at_step=4)]).run()


def test_trainer_config_takes_callbacks(tmp_path):
    from gangtrain.app import TrainerConfig

    config = TrainerConfig.model_validate(
        {"max_num_steps": 2, "progress": False,
         "callbacks": [{"name": "ext_callbacks:EventLog", "tag": "cfg"}]})
    model, batches = _regression()
    trainer = config.build(Regression(model), batches,
                           torch.optim.SGD(model.parameters(), lr=0.05), output_dir=tmp_path,
                           recorders=[])
    trainer.run()
    (log,) = [c for c in trainer.callbacks.callbacks if isinstance(c, EventLog)]
    assert log.tag == "cfg"
    assert [e[0] for e in log.events] == ["train_start", "step_end", "step_end", "train_end"]
