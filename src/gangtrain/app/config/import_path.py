"""Import paths in configs: ``package.module:attr[.attr...]`` resolved to the object.

Configs name user code (callbacks, early stoppers, ...) by import path; every such path is
resolved here, so that a mistake reads the same wherever it is made.

A config file in a run directory is data, not code: whoever can write
``OUTPUT_DIR/config.yaml`` must not get their code run by the next person who resumes or
evaluates that run. While an `ImportGate` is active (`gated_imports`), only the paths the
person running the command named themselves are imported; any other path is refused before
its module is imported (see `gangtrain.app.config.loading.load_config`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["ImportGate", "NamedConfig", "declared_return", "gated_imports", "import_object"]


@dataclass(frozen=True)
class ImportGate:
    """The import paths a command may import: ``allowed`` (those it named itself); any other
    path comes from ``source`` (an untrusted file) and is refused with ``remedy``."""

    allowed: frozenset[str]
    source: str
    remedy: str


_GATE: contextvars.ContextVar[ImportGate | None] = contextvars.ContextVar(
    "import_gate", default=None)


@contextlib.contextmanager
def gated_imports(gate: ImportGate | None) -> Iterator[None]:
    """While inside, `import_object` imports only the paths ``gate`` allows (None: any)."""
    token = _GATE.set(gate)
    try:
        yield
    finally:
        _GATE.reset(token)


def declared_return(obj: Any) -> Any:
    """The return annotation of a Python function (resolved), or None when it has none, is
    not a Python function, or the annotation cannot be resolved. Reading it calls nothing."""
    if not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        return None
    try:
        return typing.get_type_hints(obj).get("return")
    except Exception:  # an annotation naming what the module cannot resolve
        return None


def import_object(path: str, what: str) -> Any:
    """The object that ``path`` (``package.module:attr[.attr...]``) names.

    ``what`` says what the path is for (``"callback"``, ``"early stopper"``) and leads every
    error message. Raises ``ValueError`` naming ``what`` and the path when the path is
    malformed, the module fails to import (with the module's own error) or an attribute is
    missing. Nothing is checked about the object itself: the caller knows what it needs.
    """
    if not isinstance(path, str):
        raise ValueError(f"{what} path must be a string 'package.module:name', got {path!r}")
    module_name, sep, attr_path = path.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what} path '{path}' must look like 'package.module:name'")
    gate = _GATE.get()
    if gate is not None and path.strip() not in gate.allowed:
        raise ValueError(
            f"{what} '{path}' is named by {gate.source}, not by this command; a run's "
            f"config is data and its code is not run unless you name it: {gate.remedy}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # a user module can fail to import in any way
        raise ValueError(
            f"cannot import {what} '{path}': {type(err).__name__}: {err}"
        ) from None
    where = module_name
    for attr in attr_path.split("."):
        if not attr or not hasattr(obj, attr):
            raise ValueError(f"cannot import {what} '{path}': '{where}' has no attribute '{attr}'")
        obj = getattr(obj, attr)
        where = f"{where}.{attr}" if where != module_name else f"{module_name}:{attr}"
    return obj


class NamedConfig(BaseModel):
    """How a config names user code: ``{name: <import path or built-in>, **kwargs}``, or a
    bare string, short for ``{name: <string>}``. The extra keys are the keyword arguments."""

    model_config = ConfigDict(extra="allow")

    name: str

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments: every key that is not a declared field."""
        return dict(self.model_extra or {})
