"""The overhead benchmark runs end to end and prints its figures (its numbers are judged by
running it, not here: timings do not belong in tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_prints_its_ratios():
    # A trainer that did something heavy per step (a host sync, a recorder write) would be
    # several times slower at this size; a broken loop would be instant. 21 steps of 0.5 ms
    # on a loaded machine can miss once (measured 9x with 4 processes on 2 cores): a second
    # run decides.
    for _attempt in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.overhead", "--sizes", "small", "--reps", "1",
             "--steps", "21", "--no-memory"],
            cwd=ROOT, check=True, capture_output=True, text=True, timeout=120,
        ).stdout
        ratio = re.search(r"overhead small .* ratio (\d+\.\d+) \(target <= 1.03; 95% interval",
                          out)
        own = re.search(r"the trainer's own cost: .* ratio (\d+\.\d+)", out)
        assert ratio and own, out
        if 0.5 < float(ratio.group(1)) < 3.0 and 0.5 < float(own.group(1)) < 3.0:
            return
    raise AssertionError(out)


def test_the_median_interval_is_the_textbook_order_statistics():
    from benchmarks.overhead import median_interval

    # 95% distribution-free intervals of the median: n=10 -> (x2, x9); n=100 -> (x40, x61);
    # below 6 values no such interval exists.
    assert median_interval([float(i) for i in range(1, 11)]) == (2.0, 9.0)
    assert median_interval([float(i) for i in range(1, 101)]) == (40.0, 61.0)
    assert median_interval([1.0] * 5) is None


def test_the_interval_is_taken_over_medians_of_blocks_of_consecutive_pairs():
    from benchmarks.overhead import block_medians, median_interval

    # A machine whose state shifts the ratio for a while: 60 pairs in six blocks of 10, each
    # block around its own level. The pairs taken one by one give an interval of the median
    # that only spans the two middle levels; the block medians keep the drift in it.
    levels = [1.00, 1.02, 1.04, 1.06, 1.08, 1.10]
    pairs = [level + (i % 10 - 4.5) * 1e-4 for level in levels for i in range(10)]
    assert block_medians(pairs) == pytest.approx(levels)
    assert block_medians(pairs[:59]) == pytest.approx(levels[:5])  # a partial block waits
    single = median_interval(pairs)
    assert single is not None and single[1] - single[0] < 0.021
    assert median_interval(block_medians(pairs)) == pytest.approx((1.00, 1.10))


def run_benchmark(module: str, *args: str, timeout: float = 300) -> str:
    """`python -m module args` (one intra-op thread, forked from the warm Python,
    `warm_launch`): its stdout, once it exited 0."""
    proc = warm_launch.run([sys.executable, "-m", module, *args], cwd=ROOT,
                           env=warm_launch.server_env(), timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_checkpoint_benchmark_prints_save_and_load_against_the_disk():
    out = run_benchmark("benchmarks.checkpoint", "--sizes", "1", "--repeats", "1")
    for pattern in (r"save at \d+% of the disk rate", r"load at \d+% of the disk rate",
                    r"stages of a save: state dict", r"async save blocks .* of a sync save",
                    r"during a background save .* ratio \d+\.\d+ .* rounds \d+\.\d+\.\.\d+\.\d+"):
        assert re.search(pattern, out), (pattern, out)


def test_overhead_ab_switches_a_piece_per_window_and_puts_it_back(capsys):
    from benchmarks import overhead_ab
    from trainer.trainer import Trainer

    real = Trainer._sync_point
    published = []
    overhead_ab.EXPERIMENTS["test_publish"] = (
        Trainer, "_sync_point", lambda self, due, stop: published.append(self.step_nr),
        "publish steps of B windows")
    try:
        overhead_ab.measure("test_publish", runs=1, steps=40)
    finally:
        del overhead_ab.EXPERIMENTS["test_publish"]
    assert Trainer._sync_point is real  # put back for the next experiment
    # Steps 11-20 and 31-40 are the B windows of each of the two runs (warm-up and measured).
    assert published == [20, 40, 20, 40]
    assert re.search(r"test_publish +B - A +[-+]\d+\.\d us a step \(runs", capsys.readouterr().out)


def test_sft_benchmark_prints_its_figures():
    out = run_benchmark("benchmarks.sft", "--steps", "1", "--skip-rss", "--conversations", "100")
    for pattern in (r"packing: .* efficiency 0\.9\d+", r"packed / padded trained tokens/s: "
                    r"\d+\.\d+x", r"cold, 1 process: [\d,]+ tokens/s",
                    r"the same, cached: \d+\.\d+ s", r"TRL: "):
        assert re.search(pattern, out), (pattern, out)


def test_real_size_benchmark_runs_its_gpu_settings_on_a_small_shape(tmp_path):
    """The 0.5B benchmark's own path at a tiny shape, in bf16 (its GPU precision) with the
    warm-up it takes there: the SFT run, the checkpoint's figures and the table."""
    out = run_benchmark(
        "benchmarks.real_size", "--no-trl", "--only", "sft", "--dtype", "bf16", "--steps", "3",
        "--warmup", "2", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--vocab", "500", "--seq-len", "32", "--work", str(tmp_path))
    for pattern in (r"bf16 on cpu; rows of 32, 3 steps a run \(2 untimed\)",
                    r"round 1 ours sft : steps( [\d.]+,){2} [\d.]+ CPU s",
                    r"checkpoint: [\d,]+ bytes",
                    r"\| full SFT, our MFU .* \| \d\.\d+ \| >= 0\.75: (not )?met \|",
                    r"\| save / plain write \+ fsync \| [\d.]+ \| <= 1\.2: (not )?met \|"):
        assert re.search(pattern, out), (pattern, out)
