"""Checkpoint save and load times against model size, and how long a save blocks training
(async versus sync).

    .venv/bin/python -m benchmarks.checkpoint [--dir DIR] [--device cpu|cuda] [--sizes 1,10,50]

For each size (millions of parameters, as k x Linear(w, w)) with AdamW state, in one
process: two `save(blocking=True)` (write, fsync, sha256, commit), two async saves timed
until `save()` returns (state copied to host memory; the write runs in the background; the
second reuses the host buffers), and a load into a fresh model and optimizer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager


def build(
    width: int, layers: int, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    model.to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates the AdamW moments without a backward
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    return model, optim


def measure(width: int, layers: int, device: str, root: Path | None) -> None:
    model, optim = build(width, layers, device)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        gangs = setup_gangs(FakeGang(device=device))
        mgr = CheckpointManager(Path(tmp), gangs, keep_last_n=1, async_save=True)
        sync_s = []
        for step in (1, 2):
            t0 = time.perf_counter()
            mgr.save(step, model, optim, {"step": step}, blocking=True)
            sync_s.append(time.perf_counter() - t0)
        size_mb = sum(e["size"] for e in mgr.manifest(2)["files"].values()) / 1e6
        async_s = []
        for step in (3, 4):
            t0 = time.perf_counter()
            mgr.save(step, model, optim, {"step": step})
            async_s.append(time.perf_counter() - t0)
            mgr.wait()
        fresh_model, fresh_optim = build(width, layers, device)
        t0 = time.perf_counter()
        mgr.load(4, fresh_model, fresh_optim)
        load_s = time.perf_counter() - t0
        mgr.close()
    print(f"checkpoint {n_params / 1e6:.1f}M params ({size_mb:.0f} MB with AdamW state, "
          f"{device}): sync save {sync_s[1]:.3f} s, async save blocks {async_s[1]:.3f} s "
          f"(ratio {async_s[1] / sync_s[1]:.3f}), load {load_s:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    parser.add_argument("--sizes", default="1,10,50", help="millions of parameters")
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    args = parser.parse_args()
    for millions in (float(m) for m in args.sizes.split(",")):
        width = 1024 if millions < 10 else 2048 if millions < 40 else 4096
        layers = max(1, round(millions * 1e6 / (width * width + width)))
        measure(width, layers, args.device, args.dir)


if __name__ == "__main__":
    main()
