"""Checkpoint save and load against the disk's own speed, the stages of a save, how long an
async save blocks training, and the training step time while a background save runs.

    .venv/bin/python -m benchmarks.checkpoint [--dir DIR] [--device cpu|cuda] [--sizes 50]
                                              [--repeats 3]

For each size (millions of parameters, as k x Linear(w, w)) with AdamW state, in one
process, `--repeats` rounds of, in this order (so that drifts of a shared machine hit all
alike):

- the disk: the checkpoint's number of bytes written with `os.write` + `fsync` into one
  file, then read back with `os.readv` (both through the page cache, like the checkpoint);
- a sync save (`save(blocking=True)`: state, rank state, DCP write with crc32c while
  writing, fsync, manifest, rename, retention of the previous step) and a load into a fresh
  model and optimizer (verification included).

Each timed write (the disk's and the save's) starts from a drained disk (`settle`), as a
save does after minutes of training.

The medians are printed with the disk's time as a fraction of ours: 100% is the disk's speed.
Then the stages of one save, timed separately; the time an async save blocks training
(`save()` returning, plus what the step after it takes beyond a quiet step while the
parameters are copied) against a sync save; and the median training step (forward,
backward, AdamW) of the same model while a background save is being written, against steps
with no save (seven saves, four quiet steps before and four after each; the ratio is the
median of the saves' own ratios, with their range).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.manifest import fsync_dir, write_manifest
from trainer.checkpoint.state import model_optim_state
from trainer.checkpoint.writer import collect_checksums, write_shard

_BLOCK = 1 << 20
"""The disk's calls move 1 MB each: the fastest size measured here (604 MB written in 0.16 s
into the page cache with 640 KB to 8 MB calls, 0.43-0.78 s with 64 MB ones), so that the
limit printed is the disk's and not a slow way of calling it."""


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


def disk_write(path: Path, size: int) -> float:
    """Seconds to write `size` bytes with os.write and fsync them (the limit of a save)."""
    block = memoryview(os.urandom(_BLOCK))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, block[: min(left, _BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def disk_read(path: Path) -> float:
    """Seconds to read the file at `path` into memory with os.readv (the limit of a load)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(os.fstat(fd).st_size)
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            done += os.readv(fd, [view[done : done + _BLOCK]])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def settle() -> None:
    """Let the disk drain before a timed write: this VM's disk takes a burst at its full
    rate, and a second 600 MB right behind the first at 1.2-1.5x the time (measured), so
    whichever of the disk and the save came second would pay for the other."""
    os.sync()
    time.sleep(1.0)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_stages(model: torch.nn.Module, optim: torch.optim.Optimizer, root: Path) -> str:
    """The stages of one sync save of one rank, each timed on its own."""
    tmp_dir = root / "stages"
    (tmp_dir / "model_optim").mkdir(parents=True)
    t = {}
    t0 = time.perf_counter()
    state = model_optim_state(model, optim)
    t["state dict"] = time.perf_counter() - t0
    buffer = io.BytesIO()
    t["rank state"] = timed(lambda: torch.save({"step": 1}, buffer))
    t["DCP write+crc32c+fsync"] = timed(lambda: write_shard(
        tmp_dir, state, buffer.getvalue(), rank=0, process_group=None, no_dist=True))
    files: dict = {}
    t["collect checksums"] = timed(lambda: files.update(collect_checksums(tmp_dir)))

    def commit() -> None:
        write_manifest(tmp_dir, {"files": files})
        fsync_dir(tmp_dir / "model_optim")
        os.rename(tmp_dir, root / "stages_done")
        fsync_dir(root)

    t["manifest+fsync+rename"] = timed(commit)
    return ", ".join(f"{name} {seconds:.3f} s" for name, seconds in t.items())


def step_times(
    model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
    n: int | None = None, until: Callable[[], bool] | None = None,
) -> list[float]:
    """Times of training steps: `n` of them, or as many as run until `until()` is true."""
    times: list[float] = []
    while (n is not None and len(times) < n) or (until is not None and not until()):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _mark(marks: list[float], *_: object) -> None:
    marks.append(time.perf_counter())


def background_saves(mgr: CheckpointManager, model: torch.nn.Module,
                     optim: torch.optim.Optimizer, x: torch.Tensor, rounds: int,
                     sync_save: float) -> None:
    """Training steps around async saves. A save blocks the training thread until save()
    returns (the copy of what a forward may change), then in the optimizer's next step, which
    waits for the copy of the parameters and optimizer state (timed by two step pre-hooks,
    one registered before the save's own, one after). The steps while the save is written
    may be slowed: their time beyond a quiet step's, plus the blocking, is what a save costs.

    Each round brackets its save with quiet steps before and after it, and its ratio is its
    busy steps' median over its quiet steps' median: a machine drifting between rounds (this
    shared VM's step moves by 20% within minutes) then moves both sides of a ratio alike, and
    the spread of the rounds' ratios shows how far one run can be trusted."""
    quiet: list[float] = []
    busy_steps = 0
    ratios: list[float] = []
    blocked: list[float] = []
    lost: list[float] = []
    for i in range(rounds):
        quiet_here = step_times(model, optim, x, n=4)
        marks: list[float] = []
        mark = partial(_mark, marks)
        first = optim.register_step_pre_hook(mark)
        returned = timed(lambda s=20 + i: mgr.save(s, model, optim, {"step": s}))
        last = optim.register_step_pre_hook(mark)
        busy_here = step_times(model, optim, x, n=1)
        first.remove()
        last.remove()
        busy_here += step_times(model, optim, x, until=lambda: not mgr.writing)
        mgr.wait()
        quiet_here += step_times(model, optim, x, n=4)
        quiet_step = statistics.median(quiet_here)
        blocked.append(returned + marks[1] - marks[0])
        lost.append(returned + sum(busy_here) - len(busy_here) * quiet_step)
        ratios.append(statistics.median(busy_here) / quiet_step)
        quiet += quiet_here
        busy_steps += len(busy_here)
    print(f"  async save blocks training {statistics.median(blocked) * 1e3:.1f} ms = "
          f"{statistics.median(blocked) / sync_save:.1%} of a sync save (save() returning, "
          f"then the optimizer's next step waiting for the copy; median of {rounds})")
    print(f"  training step during a background save ({busy_steps} steps in {rounds} saves; "
          f"a step without one {statistics.median(quiet) * 1e3:.1f} ms): ratio "
          f"{statistics.median(ratios):.3f} (median of the rounds' ratios, each its steps' "
          f"median over the quiet steps' around its own save; rounds "
          f"{min(ratios):.3f}..{max(ratios):.3f})")
    print(f"  training time a save costs in all (blocking, and every step while it is written "
          f"beyond a quiet step): {statistics.median(lost) * 1e3:.0f} ms = "
          f"{statistics.median(lost) / sync_save:.1%} of a sync save (median of {rounds})")


def measure(width: int, layers: int, device: str, root: Path | None, repeats: int,
            rounds: int = 7) -> None:
    model, optim = build(width, layers, device)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        gangs = setup_gangs(FakeGang(device=device))
        mgr = CheckpointManager(Path(tmp) / "ckpt", gangs, keep_last_n=1, async_save=True)
        mgr.save(1, model, optim, {"step": 1}, blocking=True)  # warm-up
        size = sum(e["size"] for e in mgr.manifest(1)["files"].values())
        raw = Path(tmp) / "raw.bin"
        rows: dict[str, list[float]] = {k: [] for k in ("write", "save", "read", "load")}
        fresh_model, fresh_optim = build(width, layers, device)
        for r in range(repeats):
            settle()
            rows["write"].append(disk_write(raw, size))
            step = 2 + r
            settle()
            rows["save"].append(timed(lambda s=step: mgr.save(s, model, optim, {"step": s},
                                                              blocking=True)))
            rows["read"].append(disk_read(raw))
            rows["load"].append(timed(lambda s=step: mgr.load(s, fresh_model, fresh_optim)))
            raw.unlink()
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"checkpoint {n_params / 1e6:.1f}M params ({size / 1e6:.0f} MB with AdamW "
              f"state, {device}), medians of {repeats}:")
        print(f"  sync save {med['save']:.3f} s ({size / med['save'] / 1e9:.2f} GB/s); disk "
              f"write+fsync {med['write']:.3f} s ({size / med['write'] / 1e9:.2f} GB/s): save "
              f"at {med['write'] / med['save']:.0%} of the disk rate")
        print(f"  load {med['load']:.3f} s; disk read {med['read']:.3f} s: load at "
              f"{med['read'] / med['load']:.0%} of the disk rate")
        print(f"  stages of a save: {save_stages(model, optim, Path(tmp))}")

        x = torch.randn(16, width, device=device)
        step_times(model, optim, x, n=2)  # warm-up
        background_saves(mgr, model, optim, x, rounds, med["save"])
        mgr.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    parser.add_argument("--sizes", default="50", help="millions of parameters, e.g. 1,10,50")
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of save and load")
    args = parser.parse_args()
    for millions in (float(m) for m in args.sizes.split(",")):
        width = 1024 if millions < 10 else 2048 if millions < 40 else 4096
        layers = max(1, round(millions * 1e6 / (width * width + width)))
        measure(width, layers, args.device, args.dir, args.repeats)


if __name__ == "__main__":
    main()
