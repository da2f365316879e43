"""Seeding and the capture/restore of every random number generator, for exact resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed torch, numpy and random with `seed + rank`, so ranks draw different dropout
    masks yet every run of the same command draws the same ones."""
    s = seed + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def rng_state() -> dict[str, Any]:
    """Plain tensors, ints and lists only: loadable with `torch.load(weights_only=True)`."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached), "kind": str(kind)},
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
