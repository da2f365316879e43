"""Decisions every rank must share, made in one collective each (fairseq2's `broadcast_flag`).

A rank that decides alone (to stop, to skip a step, that a save failed) and acts on it leaves
the others waiting in a collective it never enters: under NCCL a hang, under Gloo a
mismatch. Every such decision goes through one of these helpers, called by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from gangs.errors import UserError
from gangs.gang import Gang, ReduceOperation

T = TypeVar("T")


def any_rank(gang: Gang, flag: bool) -> bool:
    """True on every rank when `flag` is True on any rank (one all-reduce)."""
    return any_rank_each(gang, [flag])[0]


def any_rank_each(gang: Gang, flags: Sequence[bool]) -> list[bool]:
    """Element-wise `any_rank` of several flags, in one all-reduce."""
    if gang.size == 1 or not flags:
        return list(map(bool, flags))
    agreed = torch.tensor([float(flag) for flag in flags], device=gang.device)
    gang.all_reduce(agreed, ReduceOperation.MAX)
    return [value > 0 for value in agreed.tolist()]


def first_error(gang: Gang, message: str | None) -> str | None:
    """The `message` of the lowest rank that has one, on every rank; None when no rank has
    one. Lets every rank raise the same clear error (name the rank in the message) instead
    of one rank raising and the others hanging in their next collective."""
    if not any_rank(gang, message is not None):
        return None
    if gang.size == 1:
        return message
    for rank in range(gang.size):  # only on failure: one small broadcast per rank
        shared = [message if rank == gang.rank else None]
        gang.broadcast_objects(shared, source_rank=rank)
        if shared[0] is not None:
            return shared[0]
    return None  # unreachable: some rank had a message


def describe(error: BaseException) -> str:
    """`"<ErrorType>: <first line>"`, for messages shared between ranks."""
    text = str(error).strip()
    name = type(error).__name__
    return f"{name}: {text.splitlines()[0]}" if text else name


def on_rank0(gang: Gang, action: Callable[[], T], what: str,
             error_type: type[Exception] = RuntimeError) -> T:
    """Run `action` on rank 0 only and return its result on every rank (picklable); when it
    raises, every rank raises `error_type` naming `what` and the cause, rather than rank 0
    alone while the others wait in their next collective."""
    outcome: list[Any] = [None, None]
    error: BaseException | None = None
    if gang.rank == 0:
        try:
            outcome[0] = action()
        except Exception as ex:
            error, outcome[1] = ex, f"{what} failed on rank 0: {describe(ex)}"
    if gang.size > 1:
        gang.broadcast_objects(outcome, source_rank=0)
    if outcome[1] is not None:
        raise error_type(outcome[1]) from error
    return outcome[0]


def rank0_first(gang: Gang, make: Callable[[], T]) -> T:
    """`make()` on rank 0 first, then on the other ranks (which then read what rank 0 left
    in a cache rather than all doing the same work at once). A `UserError` rank 0 raises is
    raised on every rank, none left waiting."""
    value: T | None = None
    message = None
    if gang.rank == 0:
        try:
            value = make()
        except UserError as error:
            message = str(error)
    message = first_error(gang, message)
    if message is not None:
        raise UserError(message)
    return make() if gang.rank != 0 else value  # type: ignore[return-value]
