"""`python -m benchmarks.gpu`: its CPU smoke run goes end to end and writes only to `--out`;
without CUDA the plain command fails with one line. (Its GPU figures are judged by running
it on a GPU, not here: timings do not belong in tests.)"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import RESULTS, main

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("device", "torch", "date", "tokens_per_s", "mfu_eager", "mfu_compiled",
        "trainer_over_loop", "host_syncs_per_step", "peak_memory_gib")
SMOKE = ["--device", "cpu", "--preset", "tiny", "--variants", "eager", "--reps", "2",
         "--warmup", "2", "--steps", "4"]


def _results_state() -> tuple[float, int] | None:
    return (RESULTS.stat().st_mtime, RESULTS.stat().st_size) if RESULTS.exists() else None


def test_cpu_smoke_run_prints_its_figures_and_writes_only_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _results_state()
    out = tmp_path / "smoke.json"
    assert main([*SMOKE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    ratio = re.search(r"eager: loop [\d.]+ ms/step .* trainer/loop ratio (\d+\.\d+) "
                      r"\(target <= 1\.01", printed)
    assert ratio and float(ratio.group(1)) > 0, printed
    assert "host syncs: not measured" in printed

    record = json.loads(out.read_text())
    assert set(KEYS) <= record.keys()
    assert record["device"] == "cpu" and record["torch"] == torch.__version__
    tokens = record["tokens_per_s"]["eager"]
    assert tokens["trainer"] > 0 and tokens["loop"] > 0
    assert math.isfinite(record["trainer_over_loop"]["eager"])
    # Figures a CPU cannot give are absent, not made up.
    assert record["mfu_eager"] is None and record["mfu_compiled"] is None
    assert record["host_syncs_per_step"] is None
    assert record["peak_memory_gib"]["eager"] == {"trainer": None, "loop": None}
    assert _results_state() == before  # the GPU results were not touched


def test_cpu_figures_never_go_to_the_gpu_results(capsys: pytest.CaptureFixture[str]) -> None:
    before = _results_state()
    assert main([*SMOKE, "--out", str(RESULTS)]) == 2
    assert main(["--device", "cpu", "--preset", "gpu"]) == 2  # the smoke run is tiny only
    errors = capsys.readouterr().err.splitlines()
    assert "CPU figures never go to" in errors[0] and "--preset tiny" in errors[1]
    assert _results_state() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says without CUDA")
def test_without_cuda_it_fails_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "error: no CUDA device" in proc.stderr
