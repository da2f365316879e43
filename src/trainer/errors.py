"""Exceptions shared by every part of gangtrain."""

from __future__ import annotations

from gangs.errors import UserError

__all__ = ["NonFiniteLossError", "UserError"]


class NonFiniteLossError(UserError):
    """The loss (or gradient norm) of a step was NaN or infinite more often than allowed."""
