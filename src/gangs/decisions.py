"""Decisions every rank must share, made in one collective each (fairseq2's `broadcast_flag`).

A rank that decides alone (to stop, to skip a step, that a save failed) and acts on it leaves
the others waiting in a collective it never enters: under NCCL a hang, under Gloo a
mismatch. Every such decision goes through one of these helpers, called by every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gangs.gang import Gang, ReduceOperation


def any_rank(gang: Gang, flag: bool) -> bool:
    """True on every rank when `flag` is True on any rank (one all-reduce)."""
    return any_rank_each(gang, [flag])[0]


def any_rank_each(gang: Gang, flags: Sequence[bool]) -> list[bool]:
    """Element-wise `any_rank` of several flags, in one all-reduce."""
    if gang.size == 1 or not flags:
        return [bool(flag) for flag in flags]
    agreed = torch.tensor([float(flag) for flag in flags], device=gang.device)
    gang.all_reduce(agreed, ReduceOperation.MAX)
    return [value > 0 for value in agreed.tolist()]


def broadcast_flag(gang: Gang, flag: bool, source_rank: int = 0) -> bool:
    """`flag` as decided on `source_rank` (e.g. rank 0's early stopper), on every rank."""
    if gang.size == 1:
        return bool(flag)
    shared = [bool(flag)]
    gang.broadcast_objects(shared, source_rank=source_rank)
    return shared[0]


def first_error(gang: Gang, message: str | None) -> str | None:
    """`"rank r: <message>"` of the lowest rank whose `message` is not None, on every rank;
    None when no rank has one. Lets every rank raise the same clear error instead of one
    rank raising and the others hanging in their next collective."""
    if not any_rank(gang, message is not None):
        return None
    if gang.size == 1:
        return f"rank {gang.rank}: {message}"
    for rank in range(gang.size):  # only on failure: one small broadcast per rank
        shared = [f"rank {rank}: {message}" if rank == gang.rank and message is not None
                  else None]
        gang.broadcast_objects(shared, source_rank=rank)
        if shared[0] is not None:
            return shared[0]
    return None  # unreachable: some rank had a message


def describe(error: BaseException) -> str:
    """`"<ErrorType>: <first line>"`, for messages shared between ranks."""
    text = str(error).strip()
    name = type(error).__name__
    return f"{name}: {text.splitlines()[0]}" if text else name
