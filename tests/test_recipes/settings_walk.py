"""Which settings of a recipe's config a real run reads: `reads_of(config, run)` records every
field of every section read (by attribute) while `run()` trains, and names the leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel


def leaves(config: BaseModel, prefix: str = "") -> dict[str, tuple[int, str]]:
    """Every setting of `config` as a dotted key -> (id of its section, field name); a
    section that is None (an optional one, off) is one leaf."""
    keys = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            keys.update(leaves(value, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = (id(config), name)
    return keys


def reads_of(config: BaseModel, run: Callable[[], Any]) -> set[str]:
    """The settings of `config` that `run()` reads."""
    keys = leaves(config)
    sections = {section for section, _ in keys.values()}
    seen: set[tuple[int, str]] = set()
    original = BaseModel.__getattribute__

    def tracking(self: BaseModel, name: str) -> Any:
        if id(self) in sections:
            seen.add((id(self), name))
        return original(self, name)

    BaseModel.__getattribute__ = tracking  # type: ignore[method-assign]
    try:
        run()
    finally:
        BaseModel.__getattribute__ = original  # type: ignore[method-assign]
    return {key for key, where in keys.items() if where in seen}
