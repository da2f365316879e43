"""How the checkpoint's free-space estimate compares with the bytes a save really writes.

    python -m benchmarks.disk_estimate

For models of many small tensors and of few large ones (AdamW state included), prints the
bytes written by `CheckpointManager.save`, the estimate `needed_bytes` gave before it, their
ratio (the estimate must not be below 1x of what is written) and DCP's bytes per tensor
beyond the data (what `disk_space._PER_TENSOR` allows for).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import trainer.checkpoint.manager as manager_module
from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager

SHAPES = [(2000, 4), (200, 1000), (20, 100_000)]  # (number of parameters, elements each)


def measure(num: int, size: int) -> tuple[int, int, int]:
    """(bytes written, bytes estimated, number of tensors saved) of one save."""
    torch.manual_seed(0)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(size)) for _ in range(num))
    optimizer = torch.optim.AdamW(model.parameters())
    sum(p.sum() for p in model).backward()
    optimizer.step()
    estimates = []
    original = manager_module.needed_bytes

    def spy(state, *args):
        estimates.append(original(state, *args))
        return estimates[-1]

    manager_module.needed_bytes = spy
    try:
        with tempfile.TemporaryDirectory() as directory:
            manager = CheckpointManager(Path(directory), setup_gangs(FakeGang()))
            manager.save(1, model, optimizer, {"step": 1})
            manager.close()
            written = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    finally:
        manager_module.needed_bytes = original
    return written, estimates[0], 3 * num  # each parameter, its exp_avg and exp_avg_sq


def main() -> None:
    for num, size in SHAPES:
        written, estimate, tensors = measure(num, size)
        data = 4 * tensors * size
        print(f"{num} parameters x {size} floats: written {written / 2**20:.2f} MiB, "
              f"estimate {estimate / 2**20:.2f} MiB, estimate/written {estimate / written:.2f}x,"
              f" DCP bytes per tensor beyond the data {(written - data) / tensors:.0f}")


if __name__ == "__main__":
    main()
