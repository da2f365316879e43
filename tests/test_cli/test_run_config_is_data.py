"""OUTPUT_DIR/config.yaml is data: the code it names by import path (callbacks, early
stoppers) is neither imported nor called unless the person running the command names it
(--set, --config-file) or passes --trust-run-config; and whatever a config names is checked
to be what its setting expects before anything is called."""

import sys

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from gangtrain.app.cli import run_recipe
from gangtrain.app.config.callbacks import CallbackConfig, build_callbacks
from gangtrain.app.config.early_stopper import EarlyStopperConfig, build_early_stopper


class TrainerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_steps: int = 10
    callbacks: list[CallbackConfig] = []
    early_stopper: EarlyStopperConfig | None = None


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trainer: TrainerSection = TrainerSection()


class BuildingMain:
    """A recipe main that builds what the config names, as the recipes' Trainer does."""

    def __init__(self):
        self.built = []

    def __call__(self, config, output_dir, resume_or_checkpoint):
        self.built.append(build_callbacks(config.trainer.callbacks))
        self.built.append(build_early_stopper(config.trainer.early_stopper, True))
        return 0


def run(out, *argv):
    main = BuildingMain()
    code = run_recipe(Config, {}, main, argv=[str(out), *argv], prog="recipe", eval_main=main)
    return code, main


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A run directory whose config.yaml names code, and a module whose import leaves a mark."""
    marker = tmp_path / "marker"
    (tmp_path / "evil_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from trainer import Callback\n"
        "class Cb(Callback):\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    (out / "checkpoints" / "step_1").mkdir(parents=True)  # for --eval-only
    yield out, marker
    sys.modules.pop("evil_module", None)


def write_run_config(out, trainer):
    (out / "config.yaml").write_text(yaml.safe_dump({"trainer": trainer}))


SYSTEM = "os:system"


@pytest.mark.parametrize("mode", [[], ["--dump-config"], ["--eval-only", "--checkpoint", "last"]])
@pytest.mark.parametrize(("setting", "value"), [
    ("trainer.callbacks.0", {"callbacks": [{"name": SYSTEM, "command": "touch {marker}"}]}),
    ("trainer.callbacks.0", {"callbacks": ["evil_module:Cb"]}),
    ("trainer.early_stopper", {"early_stopper": {"name": SYSTEM, "command": "touch {marker}"}}),
    ("trainer.early_stopper", {"early_stopper": {"name": "any_of",
                                                 "stoppers": [{"name": "evil_module:Cb"}]}}),
])
def test_code_named_only_by_the_run_config_is_never_imported_or_run(
        evil, capsys, mode, setting, value):
    out, marker = evil
    text = yaml.safe_dump(value).replace("{marker}", str(marker))
    write_run_config(out, yaml.safe_load(text))
    code, main = run(out, *mode)
    err = capsys.readouterr().err
    assert code == 2
    assert not marker.exists()
    assert "evil_module" not in sys.modules
    assert main.built == []
    assert f"error: config '{setting}" in err
    assert f"is named by {out / 'config.yaml'}, not by this command" in err
    assert "--trust-run-config" in err
    assert "Traceback" not in err


def test_the_command_naming_the_path_or_trusting_the_run_config_runs_it(evil, capsys):
    out, marker = evil
    write_run_config(out, {"callbacks": ["evil_module:Cb"]})
    code, main = run(out, "--set", "trainer.callbacks=[evil_module:Cb]")
    assert code == 0 and marker.exists()
    assert [type(c).__name__ for c in main.built[0]] == ["Cb"]
    code, main = run(out, "--trust-run-config")  # config.yaml now names it: trusted
    assert code == 0
    assert [type(c).__name__ for c in main.built[0]] == ["Cb"]
    # A config file the person passes is theirs too.
    mine = out.parent / "mine.yaml"
    mine.write_text(yaml.safe_dump({"trainer": {"callbacks": ["evil_module:Cb"]}}))
    assert run(out, "--config-file", str(mine))[0] == 0


@pytest.mark.parametrize(("trainer", "message"), [
    ({"callbacks": [{"name": SYSTEM, "command": "touch {marker}"}]},
     "config 'trainer.callbacks.0' = {"),
    ({"early_stopper": {"name": SYSTEM, "command": "touch {marker}"}},
     "config 'trainer.early_stopper' = {"),
])
def test_what_a_trusted_config_names_is_checked_before_it_is_called(
        evil, capsys, trainer, message):
    out, marker = evil
    write_run_config(out, yaml.safe_load(yaml.safe_dump(trainer).replace("{marker}", str(marker))))
    code, main = run(out, "--trust-run-config")
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists() and main.built == []
    assert message in err
    assert "os:system' is a builtin_function_or_method, not a" in err


def test_a_factory_function_must_declare_what_it_builds(tmp_path, monkeypatch, capsys):
    (tmp_path / "factories.py").write_text(
        "from trainer import Callback\n"
        "from trainer.early_stoppers import EarlyStopper\n"
        "class Cb(Callback):\n"
        "    pass\n"
        "def declared() -> Cb:\n"
        "    return Cb()\n"
        "def undeclared():\n"
        "    raise AssertionError('called')\n"
        "def stopper_factory(window: int) -> EarlyStopper:\n"
        "    return lambda step_nr, score: False\n"
        "def undeclared_stopper_factory(window):\n"
        "    raise AssertionError('called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    try:
        code, main = run(out, "--set", "trainer.callbacks=[factories:declared]", "--set",
                         "trainer.early_stopper={name: 'factories:stopper_factory', window: 2}")
        assert code == 0 and type(main.built[0][0]).__name__ == "Cb"
        assert main.built[1](1, 1.0) is False
        code, _ = run(out, "--set", "trainer.callbacks=[factories:undeclared]")
        assert code == 2
        assert "callback 'factories:undeclared' is a function, not a callback class; a " \
               "function that builds one must declare the class it returns" in \
               capsys.readouterr().err
        code, _ = run(out, "--set",
                      "trainer.early_stopper={name: 'factories:undeclared_stopper_factory', "
                      "window: 2}")
        assert code == 2
        assert "early stopper 'factories:undeclared_stopper_factory' is a function, not a " \
               "stopper" in capsys.readouterr().err
    finally:
        sys.modules.pop("factories", None)
