"""`MetricBag`: named accumulators that live on the device until they are published.

Updating never leaves the device (no `.item()`), so recording metrics every step costs a
few tensor ops. `sync_and_compute(gang)` reduces every accumulator over the gang, in one
agreed key order, and only then copies the values to the host.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import Tensor

from gangs import Gang, ReduceOperation

# kind -> (reduce operation, identity value a rank without the key contributes)
_KINDS = {
    "mean": (ReduceOperation.SUM, 0.0),  # stored as (weighted total, weight)
    "sum": (ReduceOperation.SUM, 0.0),
    "min": (ReduceOperation.MIN, math.inf),
    "max": (ReduceOperation.MAX, -math.inf),
}


class MetricBag:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._values: dict[str, Tensor] = {}  # name -> float64 tensor [2] (mean) or [1]
        self._kinds: dict[str, str] = {}

    # -- updates (device only) -------------------------------------------------------
    def update_mean(self, name: str, value: Tensor | float, weight: Tensor | float = 1.0) -> None:
        """Add `weight` observations whose average is `value`."""
        acc = self._slot(name, "mean", 2)
        acc[0] += value * weight if isinstance(value, Tensor) else _as(value * weight, acc)
        acc[1] += weight

    def update_total(self, name: str, total: Tensor | float, count: Tensor | float) -> None:
        """Add `count` observations whose sum is `total` (e.g. a summed loss and its targets)."""
        acc = self._slot(name, "mean", 2)
        acc[0] += total
        acc[1] += count

    def update_sum(self, name: str, value: Tensor | float) -> None:
        self._slot(name, "sum", 1)[0] += value

    def update_min(self, name: str, value: Tensor | float) -> None:
        acc = self._slot(name, "min", 1, fill=math.inf)
        torch.minimum(acc, _as(value, acc).reshape(1), out=acc)

    def update_max(self, name: str, value: Tensor | float) -> None:
        acc = self._slot(name, "max", 1, fill=-math.inf)
        torch.maximum(acc, _as(value, acc).reshape(1), out=acc)

    def _slot(self, name: str, kind: str, size: int, fill: float = 0.0) -> Tensor:
        acc = self._values.get(name)
        if acc is None:
            acc = torch.full((size,), fill, dtype=torch.float64, device=self.device)
            self._values[name] = acc
            self._kinds[name] = kind
        elif self._kinds[name] != kind:
            raise ValueError(f"metric '{name}' is a {self._kinds[name]}, not a {kind}")
        return acc

    # -- publish ---------------------------------------------------------------------
    def sync_and_compute(self, gang: Gang) -> dict[str, float]:
        """Reduce over `gang` and return plain floats. Every rank must call it.

        Ranks may hold different keys: they first agree on the union, sorted by name,
        so no value is ever reduced with another metric's (Lightning #21409).
        """
        keys = self._agreed_keys(gang)
        by_kind: dict[str, list[tuple[str, Tensor]]] = {k: [] for k in _KINDS}
        for key in keys:
            kind, name = key.split(":", 1)
            acc = self._values.get(name)
            if acc is None:
                size = 2 if kind == "mean" else 1
                acc = torch.full((size,), _KINDS[kind][1], dtype=torch.float64, device=self.device)
            by_kind[kind].append((name, acc))

        out: dict[str, float] = {}
        for kind, items in by_kind.items():
            if not items:
                continue
            flat = torch.cat([acc for _, acc in items])
            if gang.size > 1:
                gang.all_reduce(flat, _KINDS[kind][0])
            values = flat.tolist()  # the one host copy of this publish
            if kind == "mean":
                for i, (name, _) in enumerate(items):
                    total, weight = values[2 * i], values[2 * i + 1]
                    out[name] = total / weight if weight != 0 else math.nan
            else:
                for i, (name, _) in enumerate(items):
                    out[name] = values[i]
        return dict(sorted(out.items()))

    def _agreed_keys(self, gang: Gang) -> list[str]:
        keys = sorted(f"{self._kinds[n]}:{n}" for n in self._values)
        if gang.size == 1:
            return keys
        # Fast path: one all-reduce of a digest tells whether every rank has the same keys.
        digest = int.from_bytes(hashlib.sha256("\n".join(keys).encode()).digest()[:6], "big")
        probe = torch.tensor([digest, -digest], dtype=torch.float64, device=self.device)
        gang.all_reduce(probe, ReduceOperation.MAX)
        if probe[0].item() == digest and -probe[1].item() == digest:
            return keys
        union: set[str] = set()
        for source in range(gang.size):
            theirs = [keys]
            gang.broadcast_objects(theirs, source_rank=source)
            union.update(theirs[0])
        return sorted(union)

    def reset(self) -> None:
        self._values.clear()
        self._kinds.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def state_dict(self) -> dict[str, Any]:
        return {
            name: {"kind": self._kinds[name], "value": acc.cpu().tolist()}
            for name, acc in self._values.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        for name, entry in state.items():
            self._kinds[name] = entry["kind"]
            self._values[name] = torch.tensor(
                entry["value"], dtype=torch.float64, device=self.device
            )


def _as(value: Tensor | float, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(like.dtype)
    return torch.tensor(value, dtype=like.dtype, device=like.device)
