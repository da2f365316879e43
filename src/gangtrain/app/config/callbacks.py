"""A callback named in a config (`trainer.callbacks: [{name: "pkg.mod:Class", ...}]`),
checked when the config is validated and built into a `Callback`."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from pydantic import model_validator

from gangtrain.app.config.import_path import NamedConfig, declared_return, import_object
from trainer.errors import UserError
from trainer.observe.callbacks import EVENTS, Callback, implemented_events


class CallbackConfig(NamedConfig):
    """A callback in a config: ``{name: "package.module:Class", **kwargs}``.

    ``name`` is the import path of a `Callback` subclass (or of any class with at least one
    of the event methods, or of a function that declares it returns such a class:
    ``def make() -> MyCallback``); every other key is a keyword argument of it. A bare
    string is short for ``{name: <string>}``. Checked when the config is validated, before
    anything named is called: the path imports, the class (or the declared return class) is
    a callback, and the arguments bind to the signature. The object is built by `build` /
    `build_callbacks`.
    """


    @model_validator(mode="after")
    def _check(self) -> CallbackConfig:
        obj = import_object(self.name, "callback")
        if not callable(obj):
            raise ValueError(f"callback '{self.name}' is a {type(obj).__name__}, not a class")
        # What `obj` builds is judged before it is ever called: a class by itself, a function
        # by the class it declares to return (anything else, e.g. 'os:system', is refused).
        built = obj if inspect.isclass(obj) else declared_return(obj)
        if not inspect.isclass(built):
            raise ValueError(
                f"callback '{self.name}' is a {type(obj).__name__}, not a callback class; a "
                "function that builds one must declare the class it returns (-> MyCallback)"
            )
        if not issubclass(built, Callback) and not implemented_events(built):
            raise ValueError(
                f"callback '{self.name}' is not a callback: subclass trainer.Callback or "
                f"define one of {', '.join(EVENTS)}"
            )
        try:
            inspect.signature(obj).bind(**self.kwargs)
        except TypeError as err:
            raise ValueError(f"callback '{self.name}': {err}") from None
        except ValueError:  # no signature to check against (some builtins)
            pass
        return self

    def build(self) -> Callback:
        """A new callback object; a `UserError` naming the path when it cannot be built."""
        obj = import_object(self.name, "callback")
        try:
            callback = obj(**self.kwargs)
        except Exception as err:
            raise UserError(
                f"callback '{self.name}' could not be built: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(callback, Callback) and not implemented_events(callback):
            raise UserError(
                f"callback '{self.name}' returned {callback!r}, which is not a callback: "
                f"subclass trainer.Callback or define one of {', '.join(EVENTS)}"
            )
        return callback


def build_callbacks(configs: Sequence[CallbackConfig] | None) -> list[Callback]:
    """The callbacks of ``configs`` (``trainer.callbacks``), built in order."""
    return [config.build() for config in configs or ()]
