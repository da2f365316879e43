"""Early stopper policies and their config forms."""

import math
import sys
import textwrap

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from gangtrain.app.config.early_stopper import EarlyStopperConfig, build_early_stopper
from trainer.early_stoppers import (
    AnyOf,
    Patience,
    Threshold,
    any_of,
    divergence,
    non_finite,
    patience,
    threshold,
)
from trainer.errors import UserError


def _decisions(stopper, scores):
    return [stopper(step_nr, score) for step_nr, score in enumerate(scores, start=1)]


def test_patience_with_min_delta_stops_at_the_expected_call():
    # 1.0 and 0.9 improve; 0.895 is not better by more than 0.01 (bad 1); 0.85 improves and
    # resets; 0.845 and 0.842 improve by less than min_delta (bad 1, 2); 0.848 is bad 3: stop.
    scores = [1.0, 0.9, 0.895, 0.85, 0.845, 0.842, 0.848]
    stopper = patience(3, min_delta=0.01)
    assert _decisions(stopper, scores) == [False] * 6 + [True]
    assert stopper.best == 0.85  # small improvements do not move the best score


def test_patience_higher_is_better():
    stopper = patience(2, lower_better=False)
    assert _decisions(stopper, [0.5, 0.6, 0.6, 0.7, 0.69, 0.1]) == [False] * 5 + [True]


def test_patience_nan_never_improves():
    stopper = patience(2)
    assert _decisions(stopper, [math.nan, 1.0, math.nan, math.nan]) == [False, False, False, True]


def test_builtin_state_round_trips_through_its_state_dict():
    history = list(enumerate([1.0, 0.9, 0.895, 0.85, 0.845], start=1))
    original = any_of(patience(3, min_delta=0.01), threshold(0.5))
    for step_nr, score in history:
        original(step_nr, score)
    state = original.state_dict()
    resumed = any_of(patience(3, min_delta=0.01), threshold(0.5))
    resumed.load_state_dict(state)  # what the trainer does on resume
    assert (resumed.stoppers[0].best, resumed.stoppers[0].num_bad) == (0.85, 1)
    assert _decisions(resumed, [0.846, 0.847]) == _decisions(original, [0.846, 0.847])
    assert resumed(8, 0.844) is True


def test_threshold():
    assert _decisions(threshold(0.5), [0.9, 0.51, 0.5]) == [False, False, True]
    assert _decisions(threshold(0.8, lower_better=False), [0.1, 0.8]) == [False, True]
    assert threshold(0.5)(1, math.nan) is False


def test_divergence():
    assert _decisions(divergence(10.0), [3.0, 10.0, 10.5]) == [False, False, True]
    assert _decisions(divergence(0.2, lower_better=False), [0.5, 0.2, 0.1]) == [False, False, True]
    assert divergence(10.0)(1, math.nan) is True


def test_non_finite():
    stopper = non_finite()
    assert _decisions(stopper, [1.0, 1e30, -1.0]) == [False] * 3
    assert stopper(4, math.inf) and stopper(5, -math.inf) and stopper(6, math.nan)


def test_any_of_calls_every_stopper():
    calls = []

    def always(step_nr, score):
        calls.append(step_nr)
        return True

    stopper = any_of(always, patience(2))
    assert stopper(1, 1.0) is True
    assert stopper(2, 1.0) is True
    assert calls == [1, 2]
    assert stopper.stoppers[1].num_bad == 1  # called even though `always` said stop first


def test_reprs():
    assert repr(patience(3, min_delta=0.01)) == "patience(3, min_delta=0.01)"
    assert repr(threshold(0.5, lower_better=False)) == "threshold(0.5, lower_better=False)"
    assert repr(any_of(divergence(10), non_finite())) == "any_of(divergence(10.0), non_finite())"


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: patience(0), "'patience'"),
        (lambda: patience(2.5), "'patience'"),
        (lambda: patience(2, min_delta=-0.1), "'min_delta'"),
        (lambda: threshold(math.nan), "'value'"),
        (lambda: divergence("big"), "'value'"),
        (lambda: threshold(1.0, lower_better="yes"), "'lower_better'"),
        (lambda: any_of(), "'stoppers'"),
    ],
)
def test_bad_arguments_name_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    early_stopper: EarlyStopperConfig | None = None


def _build(data, lower_better=True):
    config = Section.model_validate({"early_stopper": data}).early_stopper
    return build_early_stopper(config, lower_better)


def test_config_forms_build_the_right_stopper():
    assert _build(None) is None
    stopper = _build({"name": "patience", "patience": 5, "min_delta": 0.001}, lower_better=False)
    assert isinstance(stopper, Patience)
    assert (stopper.patience, stopper.min_delta, stopper.lower_better) == (5, 0.001, False)
    assert repr(_build({"name": "threshold", "value": 2})) == "threshold(2.0)"
    assert repr(_build({"name": "divergence", "value": 9.5})) == "divergence(9.5)"
    assert repr(_build("non_finite")) == "non_finite()"
    stopper = _build(
        {"name": "any_of", "stoppers": [{"name": "patience", "patience": 2}, "non_finite"]}
    )
    assert isinstance(stopper, AnyOf)
    assert repr(stopper) == "any_of(patience(2, min_delta=0.0), non_finite())"


def test_build_gives_fresh_state_each_time():
    config = EarlyStopperConfig(name="patience", patience=1)
    first = build_early_stopper(config, lower_better=True)
    first(1, 1.0)
    assert first(2, 1.0) is True
    second = build_early_stopper(config, lower_better=True)
    assert second(1, 1.0) is False


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"name": "patiense", "patience": 3},
            "unknown early stopper 'patiense'; did you mean 'patience'?",
        ),
        (
            {"name": "patience", "patiense": 3},
            "unknown argument 'patiense' for early stopper 'patience'",
        ),
        ({"name": "patience"}, "early stopper 'patience' needs 'patience'"),
        ({"name": "threshold", "value": 1, "lower_better": False}, "trainer.lower_better"),
        ({"name": "non_finite", "value": 1}, "'non_finite'; it takes no arguments"),
        ({"name": "any_of", "stoppers": []}, "non-empty 'stoppers'"),
        (
            {"name": "threshold", "value": 1, "stoppers": ["non_finite"]},
            "only allowed with name 'any_of'",
        ),
    ],
)
def test_bad_config_fails_validation(data, message):
    with pytest.raises(ValidationError, match=message):
        Section.model_validate({"early_stopper": data})


def test_nested_error_is_located():
    data = {"name": "any_of", "stoppers": ["non_finite", {"name": "patience", "patience": -1}]}
    with pytest.raises(ValidationError) as info:
        Section.model_validate({"early_stopper": data})
    [error] = info.value.errors()
    assert error["loc"] == ("early_stopper", "stoppers", 1)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_stoppers.py").write_text(
        textwrap.dedent(
            """
            def stop_at_ten(step_nr, score):
                return step_nr >= 10

            from trainer.early_stoppers import EarlyStopper

            def stop_when_flat(window=3, tol=0.0, lower_better=True) -> EarlyStopper:
                seen = []

                def stopper(step_nr, score):
                    seen.append(score)
                    recent = seen[-window:]
                    return len(recent) == window and max(recent) - min(recent) <= tol

                stopper.lower_better = lower_better
                return stopper

            def forgets_to_return(step_nr, score):
                pass

            class Namespace:
                def stop(step_nr, score):
                    return True
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_stoppers"
    sys.modules.pop("my_stoppers", None)  # the next test's copy lives in another tmp_path


def test_user_function_is_used_directly(user_module):
    stopper = _build({"name": f"{user_module}:stop_at_ten"})
    assert (stopper(9, 1.0), stopper(10, 1.0)) == (False, True)
    assert repr(stopper) == "my_stoppers:stop_at_ten"
    assert _build(f"{user_module}:Namespace.stop")(1, 1.0) is True


def test_user_factory_gets_kwargs_and_direction(user_module):
    stopper = _build({"name": f"{user_module}:stop_when_flat", "window": 2}, lower_better=False)
    assert _decisions(stopper, [1.0, 2.0, 2.0]) == [False, False, True]
    assert stopper.stopper.lower_better is False  # passed because the factory takes it
    assert repr(stopper) == "my_stoppers:stop_when_flat(window=2)"
    assert _build(f"{user_module}:stop_when_flat")(1, 1.0) is False  # no kwargs: still a factory


def test_user_path_errors_fail_validation(user_module):
    with pytest.raises(ValidationError, match="cannot import early stopper 'my_stoppers:nope'"):
        _build(f"{user_module}:nope")
    with pytest.raises(ValidationError, match="cannot import early stopper 'no_such_pkg.mod:f'"):
        _build("no_such_pkg.mod:f")
    with pytest.raises(ValidationError, match="'my_stoppers:stop_when_flat'.*'windw'"):
        _build({"name": f"{user_module}:stop_when_flat", "windw": 2})


def test_user_stopper_must_return_a_decision(user_module):
    stopper = _build(f"{user_module}:forgets_to_return")
    with pytest.raises(UserError, match="'my_stoppers:forgets_to_return' returned None at step 4"):
        stopper(4, 1.0)


def test_threshold_class_is_the_function():
    assert isinstance(threshold(1.0), Threshold)
