"""Names that moved keep working for one release, with a warning naming where they went.

A moved module leaves a shim at its old path whose body calls `alias_module`: importing the
old name warns once and hands back the new module itself (one module object: classes stay
the same classes). A module that lost some names gets a module-level `__getattr__` from
`forward_names`: the old name warns once and returns the object from its new home.

The new homes are imported by name when first asked for, so a shim in a low package (gangs,
parallel) does not import the packages above it. Here because `gangs` is the bottom package:
any package may use it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

_warned: set[str] = set()


def warn_moved(old: str, new: str) -> None:
    """One `FutureWarning` per process for `old`, naming `new`."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} has moved to {new}: import it from there (the old name is an alias "
                  "kept for one release)", FutureWarning, stacklevel=4)


def alias_module(old: str, new: str) -> None:
    """In the body of the shim at `old`: warn, and make `old` the module `new`."""
    warn_moved(old, new)
    sys.modules[old] = importlib.import_module(new)


def alias_package(old: str, new: str) -> None:
    """In the `__init__` of the shim package at `old`: warn, make `old` the package `new`, and
    every `old.sub.module` the module `new.sub.module` itself (not a second copy of it)."""
    warn_moved(old, new)
    if not any(isinstance(f, _AliasFinder) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(old, new))
    sys.modules[old] = importlib.import_module(new)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `old.x.y` as the already-imported module `new.x.y`."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> Any:
        if not fullname.startswith(self.old + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        return importlib.import_module(self.new + spec.name[len(self.old):])

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed under its new name already."""


def forward_names(old_module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`: `names` maps each moved name to its new home,
    'package.module' (a module), 'package.module:attribute' (dots reach inside it), or
    'gone:replacement' (a name with no one-to-one successor: calling it refuses by name)."""
    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        old = f"{old_module}.{name}"
        if module == "gone":
            warn_moved(old, attribute)
            return _gone(old, attribute)
        warn_moved(old, target.replace(":", "."))
        found = importlib.import_module(module)
        for part in attribute.split(".") if attribute else ():
            found = getattr(found, part)
        return found
    return __getattr__


def _gone(old: str, replacement: str) -> Callable[..., Any]:
    def gone(*args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{old} is gone: use {replacement}")
    return gone
