"""Import paths in configs: ``package.module:attr[.attr...]`` resolved to the object.

Configs name user code (callbacks, early stoppers, ...) by import path; every such path is
resolved here, so that a mistake reads the same wherever it is made.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["NamedConfig", "import_object"]


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
