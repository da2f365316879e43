"""The config form of early stoppers: ``EarlyStopperConfig`` and ``build_early_stopper``.

In YAML, ``EarlyStopperConfig`` selects a built-in by name or a user function by import path::

    trainer:
      early_stopper: {name: patience, patience: 5, min_delta: 0.001}
      # early_stopper: {name: threshold, value: 2.5}
      # early_stopper: {name: divergence, value: 10.0}
      # early_stopper: non_finite
      # early_stopper: {name: any_of, stoppers: [{name: patience, patience: 5}, non_finite]}
      # early_stopper: {name: "mypkg.stoppers:stop_when_flat", window: 3}

The direction (``lower_better``) of the built-ins always comes from the trainer's setting, so
that it cannot disagree with the score it judges. The policies themselves are in
`trainer.early_stoppers`.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from gangtrain.app.config.import_path import NamedConfig, declared_return, import_object
from trainer.early_stoppers import (
    AnyOf,
    Divergence,
    EarlyStopper,
    NonFinite,
    Patience,
    Threshold,
)
from trainer.errors import UserError

__all__ = ["ConfiguredStopper", "EarlyStopperConfig", "build_early_stopper"]


class _UserStopper:
    """Wraps a user's stopper to check what it returns: a factory mistaken for the stopper
    itself would return a (truthy) callable and stop the run at its first validation."""

    def __init__(self, stopper: EarlyStopper, label: str) -> None:
        self.stopper = stopper
        self.label = label

    def __call__(self, step_nr: int, score: float) -> bool:
        decision = self.stopper(step_nr, score)
        if decision is None or callable(decision):
            raise UserError(
                f"early stopper '{self.label}' returned {decision!r} at step {step_nr}; "
                "it must return True (stop) or False"
            )
        return bool(decision)

    def __repr__(self) -> str:
        return self.label


# Config keys of each built-in (the keywords of its constructor). `lower_better` is left out
# on purpose: it comes from the trainer.
_BUILTIN_KWARGS: dict[str, dict[str, str]] = {
    "patience": {"patience": "patience", "min_delta": "min_delta"},
    "threshold": {"value": "value"},
    "divergence": {"value": "value"},
    "non_finite": {},
    "any_of": {},  # takes `stoppers`, a declared field
}
_BUILTIN_REQUIRED = {"patience": ("patience",), "threshold": ("value",), "divergence": ("value",)}


_BUILTIN_FACTORIES: dict[str, Callable[..., EarlyStopper]] = {
    "patience": Patience,
    "threshold": Threshold,
    "divergence": Divergence,
    "non_finite": NonFinite,
}


def _import_object(path: str) -> Any:
    """The early stopper (or its factory) that ``path`` names; ValueError naming the path."""
    obj = import_object(path, "early stopper")
    if not callable(obj):
        raise ValueError(f"early stopper '{path}' is not callable: {obj!r}")
    return obj


def _is_stopper_function(obj: Any) -> bool:
    """True for a callable used as the stopper itself: a Python function with exactly two
    required positional parameters, ``(step_nr, score)``. Anything else is a factory."""
    if not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): assume a factory
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is inspect.Parameter.empty]
    return len(required) == 2 and all(p.kind in positional for p in required)


def _has_call(cls: Any) -> bool:
    """Whether instances of the class ``cls`` are callable (a ``__call__`` of its own)."""
    return inspect.isclass(cls) and any("__call__" in vars(k) for k in cls.__mro__
                                        if k is not object)


def _is_declared_factory(obj: Any) -> bool:
    """A factory of stoppers as declared, before anything is called: a class whose instances
    are callable, or a Python function whose return annotation is a callable type
    (``-> EarlyStopper``, a ``Callable[...]``, a class with ``__call__``)."""
    if inspect.isclass(obj):
        return _has_call(obj)
    returns = declared_return(obj)
    origin = typing.get_origin(returns)
    return _has_call(returns) or returns is Callable or origin in (Callable, typing.Callable)


def _accepts_keyword(obj: Any, name: str) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(name)
    return param is not None and param.kind is not inspect.Parameter.POSITIONAL_ONLY


class EarlyStopperConfig(NamedConfig):
    """Selects an early stopper in a config file.

    ``name`` is a built-in (``patience``, ``threshold``, ``divergence``, ``non_finite``,
    ``any_of``) or an import path ``package.module:function``; the other keys are its arguments:

    - ``patience``: ``patience`` (int >= 1, required), ``min_delta`` (float >= 0, default 0);
    - ``threshold`` / ``divergence``: ``value`` (float, required);
    - ``non_finite``: none;
    - ``any_of``: ``stoppers``, a list of early stopper configs;
    - an import path: any keyword arguments. A function ``(step_nr, score)`` given without
      arguments is the stopper itself; otherwise the object is a factory called with the
      arguments (plus ``lower_better`` if it takes that keyword and it is not given) that
      returns the stopper. A factory is a class whose instances are stoppers, or a function
      declared as one (``def make(window=3) -> EarlyStopper``): nothing else named in a
      config is called.

    A bare string is short for ``{name: <string>}``. Everything is checked when the config is
    validated (names, import paths, argument names and values), not when training runs.
    ``lower_better`` is not a key of the built-ins: it comes from the trainer's setting.

    To replace (rather than merge into) a stopper set by a preset or an earlier file, set
    ``trainer.early_stopper`` to null first.
    """

    stoppers: list[EarlyStopperConfig] | None = Field(
        default=None, exclude_if=lambda stoppers: stoppers is None
    )



    @property
    def is_builtin(self) -> bool:
        return self.name in _BUILTIN_KWARGS

    @model_validator(mode="after")
    def _check(self) -> EarlyStopperConfig:
        if self.stoppers is not None and self.name != "any_of":
            raise ValueError(f"'stoppers' is only allowed with name 'any_of', not '{self.name}'")
        if self.is_builtin:
            self._check_builtin()
        elif ":" in self.name:
            self._check_user_path()
        else:
            close = difflib.get_close_matches(self.name, _BUILTIN_KWARGS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(
                f"unknown early stopper '{self.name}'; {hint}built-ins: "
                f"{', '.join(_BUILTIN_KWARGS)}, or an import path 'package.module:function'"
            )
        return self

    def _check_builtin(self) -> None:
        allowed = _BUILTIN_KWARGS[self.name]
        for key in self.kwargs:
            if key == "lower_better":
                raise ValueError(
                    f"early stopper '{self.name}' takes its direction from trainer.lower_better; "
                    "remove 'lower_better'"
                )
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                if close:
                    hint = f"did you mean '{close[0]}'?"
                elif allowed:
                    hint = f"allowed: {', '.join(allowed)}"
                else:
                    hint = "it takes no arguments"
                raise ValueError(
                    f"unknown argument '{key}' for early stopper '{self.name}'; {hint}"
                )
        for key in _BUILTIN_REQUIRED.get(self.name, ()):
            if key not in self.kwargs:
                raise ValueError(f"early stopper '{self.name}' needs '{key}'")
        if self.name == "any_of":
            if not self.stoppers:
                raise ValueError("early stopper 'any_of' needs a non-empty 'stoppers' list")
        else:
            # Build one to check the values (the constructors are pure and cheap).
            _build_builtin(self, lower_better=True)

    def _check_user_path(self) -> None:
        obj = _import_object(self.name)
        if not self.kwargs and _is_stopper_function(obj):
            return
        if not _is_declared_factory(obj):
            raise ValueError(
                f"early stopper '{self.name}' is a {type(obj).__name__}, not a stopper: name "
                "a function (step_nr, score) -> bool, a class whose instances are one, or a "
                "factory function that declares it returns one (-> EarlyStopper)"
            )
        try:
            inspect.signature(obj).bind(**self.kwargs)
        except TypeError as err:
            raise ValueError(f"early stopper factory '{self.name}': {err}") from None
        except ValueError:  # no signature to check against
            pass


def _build_builtin(config: EarlyStopperConfig, lower_better: bool | None) -> EarlyStopper:
    renamed = {_BUILTIN_KWARGS[config.name][key]: value for key, value in config.kwargs.items()}
    factory = _BUILTIN_FACTORIES[config.name]
    if config.name == "non_finite":
        return factory()
    return factory(**renamed, lower_better=lower_better)


def build_early_stopper(
    config: EarlyStopperConfig | None, lower_better: bool | None
) -> EarlyStopper | None:
    """Builds a fresh stopper from its config (None -> None, no early stopping).

    ``lower_better`` is the run's score direction (the Trainer decides it, from the setting
    or what the valid unit declares, and hands it over through `ConfiguredStopper`; None
    here: a user factory keeps its own default). Call it again to get a stopper with fresh state (e.g. before
    replaying a resumed run's score history).
    """
    if config is None:
        return None
    if config.name == "any_of":
        assert config.stoppers  # checked by the config validator
        children = [build_early_stopper(child, lower_better) for child in config.stoppers]
        return AnyOf(*[child for child in children if child is not None])
    if config.is_builtin:
        return _build_builtin(config, lower_better)

    obj = _import_object(config.name)
    kwargs = config.kwargs
    label = config.name
    if not kwargs and _is_stopper_function(obj):
        return _UserStopper(obj, label)
    if (lower_better is not None and "lower_better" not in kwargs
            and _accepts_keyword(obj, "lower_better")):
        kwargs["lower_better"] = lower_better
    if not _is_declared_factory(obj):  # the config's validator refused it already
        raise UserError(f"early stopper '{config.name}' is not a declared stopper factory")
    stopper = obj(**kwargs)
    if not callable(stopper):
        raise UserError(
            f"early stopper factory '{config.name}' returned {stopper!r}, which is not a "
            "callable (step_nr, score) -> bool"
        )
    shown = ", ".join(f"{key}={value!r}" for key, value in config.kwargs.items())
    return _UserStopper(stopper, f"{label}({shown})")


class ConfiguredStopper:
    """The early stopper a config names, built when the Trainer hands it the run's score
    direction (`follow`, as built-ins take it): the direction is decided in one place, the
    Trainer's `trainer.score_direction`, never again by the config. Then it is that stopper:
    called, saved and restored (`state_dict`, when it has one) and shown as it."""

    def __init__(self, config: EarlyStopperConfig) -> None:
        self.config = config
        self.built: EarlyStopper | None = None

    def follow(self, lower_better: bool) -> None:
        self.built = build_early_stopper(self.config, lower_better)

    def __call__(self, step_nr: int, score: float) -> bool:
        assert self.built is not None, "the Trainer calls follow() at construction"
        return bool(self.built(step_nr, score))

    def __getattr__(self, name: str) -> Any:  # `state_dict` and the like, if it has them
        built = self.__dict__.get("built")
        if built is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(built, name)

    def __repr__(self) -> str:
        return repr(self.built) if self.built is not None else f"<{self.config.name}>"
