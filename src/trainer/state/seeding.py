"""Seeding and the capture/restore of every random number generator, for exact resume."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from gangs import Gangs
from trainer.state.train_state import TrainState

log = logging.getLogger("gangtrain")


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


class RngState:
    """Every random stream of this rank, as a checkpointable component.

    Per-rank streams belong to one parallel layout: a checkpoint written under another
    (other world size or dp/tp/ep sizes, which DCP reshards the model across) cannot hand
    them over, so they are re-seeded from `seed + step_nr` instead, the same on every run.
    """

    def __init__(self, seed: int | None, gangs: Gangs, train_state: TrainState) -> None:
        self.seed = seed
        self.gangs = gangs
        self.train_state = train_state  # loaded first: its step seeds a resharded resume

    def seed_all(self) -> None:
        if self.seed is not None:
            seed_everything(self.seed, self.gangs.root.rank)

    def _layout(self) -> list[int]:
        g = self.gangs
        return [g.root.size, g.dp.size, g.tp.size, g.ep.size]

    def state_dict(self) -> dict[str, Any]:
        return {"streams": rng_state(), "layout": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step_nr = self.train_state.step_nr
        if list(state["layout"]) == self._layout():
            set_rng_state(state["streams"])
            return
        log.warning("resuming step %d under a different parallel layout: model and "
                    "optimizer resharded, random streams re-seeded",
                    step_nr)
        seed_everything((self.seed or 0) + step_nr, self.gangs.root.rank)
