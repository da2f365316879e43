"""Build on meta, shard, materialise: a rank's peak memory during the build is about its
shard plus one full parameter, never the whole model (which the eager build holds).

Measured in fresh torchrun workers (this file is also their script): a process forked from
the test runner reuses heap pages the runner freed, and its RSS would miss them.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPT, GPTConfig, num_parameters
from recipes.lm.recipe import build_model

REPO = Path(__file__).resolve().parents[2]
# 14.4M parameters (57 MB) in 98 tensors; the largest (w1, w2) are 4% of the model.
CONFIG = GPTConfig(seq_len=256, dim=384, num_layers=8, num_heads=6)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def peak_rss_growth(build: Callable[[], object]) -> int:
    """How far this process's resident set (anonymous and file pages) rose above its level
    at the start while `build` ran: the kernel's high-water mark, reset to now first."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (this process only)
    before = _status_bytes("VmRSS")
    model = build()
    peak = _status_bytes("VmHWM")
    del model
    return peak - before


def worker(out: Path) -> None:
    """One torchrun worker: the RSS growth of the meta build, then of the eager build,
    written to `out/rank_N.json`."""
    gangs = setup_gangs(setup_root_gang())
    # A first small build, so one-time costs (lazy imports, DTensor caches) are not counted.
    build_model(GPTConfig(seq_len=8, dim=16, num_layers=2, num_heads=2), gangs, "fsdp")
    with_meta = peak_rss_growth(lambda: build_model(CONFIG, gangs, "fsdp", seed=0))
    # The whole model on every rank, as a build before sharding does; the heap pages the
    # first build freed go back to the system first, so reusing them counts.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    eager = peak_rss_growth(lambda: GPT(CONFIG))
    (out / f"rank_{gangs.root.rank}.json").write_text(json.dumps([with_meta, eager]))
    gangs.close()


def growth_per_rank(out: Path) -> list[list[int]]:
    """[meta build, eager build] RSS growth of each of 4 fresh torchrun workers."""
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         __file__, str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(4)]


def test_each_rank_builds_a_4_rank_fsdp_model_in_a_fraction_of_its_size(tmp_path):
    with torch.device("meta"):
        full = 4 * num_parameters(GPT(CONFIG))  # bytes of float32
    # Measured: 0.28-0.32 of the model per rank (a quarter shard, one full parameter of 0.04
    # and allocator slack); the eager build 0.76-1.01 (the measure sees most of a whole model;
    # how much of the heap the meta build freed is reused depends on what was imported).
    for rank, (with_meta, eager) in enumerate(growth_per_rank(tmp_path)):
        assert with_meta < 0.4 * full, f"rank {rank}: {with_meta / full:.2f} of the model"
        assert eager > 0.7 * full, f"rank {rank}: eager build {eager / full:.2f}"


if __name__ == "__main__":  # a torchrun worker
    worker(Path(sys.argv[1]))
