"""How long does a checkpoint save block training, async versus sync?

    .venv/bin/python -m benchmarks.checkpoint_async [--dir DIR] [--device cpu|cuda]

A model of ~50M parameters (3 x Linear(4096, 4096)) with AdamW state (~600 MB in all) is
saved in one process: twice with `save(blocking=True)` (write, fsync, sha256, commit), then
twice asynchronously, timing only until `save()` returns (the state is copied to host
memory; the write runs in the background). The first async save also allocates the host
buffers, the second reuses them: the summary compares the second save of each kind.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    args = parser.parse_args()

    model, optim = build(args.width, args.layers, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        gangs = setup_gangs(FakeGang(device=args.device))
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
            t0 = time.perf_counter()
            mgr.wait()
            wait_s = time.perf_counter() - t0
        mgr.close()

    print(f"{n_params / 1e6:.1f}M parameters on {args.device} + AdamW state, {size_mb:.0f} MB on disk; "
          f"first sync save {sync_s[0]:.2f} s, first async save {async_s[0]:.3f} s "
          "(allocates host buffers), "
          f"background write + commit of the last one {wait_s:.2f} s after it returned")
    print(f"async save blocking time: {async_s[1]:.3f} s vs sync {sync_s[1]:.3f} s "
          f"(ratio {async_s[1] / sync_s[1]:.3f})")


if __name__ == "__main__":
    main()
