"""What the TRL comparisons of the post-training objectives share (`benchmarks.reward_trl`,
`benchmarks.kto_trl`, `benchmarks.distill_trl`): each run a fresh process of its own (so its
peak RSS is its own), the two frameworks alternated round by round (A, B, then B, A: a
machine whose load drifts favours neither), medians over rounds, ratios ours over TRL.

A child prints one ``RESULT {json}`` line; the parent reads it. Step times: ours from the
run's published ``steps_per_s`` (validation left out), TRL's from a callback at each step's
start and end; both the median over the steps after ``warmup``. In a child every clock those
read is the main thread's CPU time (``time.perf_counter`` is ``time.thread_time`` there, as
`benchmarks.overhead_trees --cpu-clock` does): with one intra-op thread and no data workers
the step runs on that thread, so the time the process waits for a core on a machine shared
with other work is left out of both frameworks' figures (rates are per CPU second).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


QWEN2_HEAD_SHARE = 0.275
"""The LM head's share of a token's matmul parameters in Qwen2-0.5B-Instruct (TRL's GKD
example student): 136.1M (896 x 151,936) of 494.0M."""


def padded_vocab(hidden: int, layers: int, head_share: float) -> int | None:
    """The vocabulary rows at which a tiny Llama's head (hidden x rows) holds ``head_share``
    of its matmul parameters (a layer of `gangtrain.tiny.chat` holds 9 hidden^2: attention
    3, the MLP of 2 x hidden 6), rounded up to 64; None at 0 (the tokenizer's 320). At 320
    rows the head is 3%: the loss's head and softmax, which a framework may run on the
    trained tokens only, are then no part of the step, as they are in every real model."""
    if head_share == 0:
        return None
    return max(320, math.ceil(head_share / (1 - head_share) * 9 * layers * hidden / 64) * 64)


def require_trl() -> str:
    """TRL's version, or exit with how to get it (a benchmark dependency only)."""
    try:
        import trl
    except ImportError:
        raise SystemExit("trl is not installed: pip install trl==1.16.0 (the comparison "
                         "needs it; or put a directory holding it on PYTHONPATH)") from None
    return trl.__version__


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def print_result(result: dict[str, Any]) -> None:
    """A child's answer, with its peak RSS, for `run_child`."""
    print("RESULT " + json.dumps({**result, "peak_rss_gib": peak_rss_gib()}), flush=True)


def run_child(module: str, argv: Sequence[str], timeout: float = 1800) -> dict[str, Any]:
    """``python -m module argv`` in a fresh process, one intra-op thread; its RESULT."""
    path = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": os.pathsep.join(path)}
    run = ("import runpy, sys, time; time.perf_counter = time.thread_time; "
           f"sys.argv = [{module!r}, *sys.argv[1:]]; runpy.run_module({module!r}, "
           "run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", run, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{module} {' '.join(argv)} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def our_train_records(out: Path) -> list[dict[str, Any]]:
    """The run's published train records (``trainer.publish_metrics_every_n_steps=1``)."""
    return [json.loads(line) for line in (out / "metrics" / "train.jsonl").read_text()
            .splitlines()]


def our_step_s(out: Path, warmup: int) -> float:
    """Our median step time over the steps after ``warmup``."""
    return statistics.median(1 / r["steps_per_s"] for r in our_train_records(out)[warmup:])


def step_timer() -> tuple[Any, list[float]]:
    """(a TRL `TrainerCallback`, the list its step times go to, seconds each). The callback's
    ``loop_times``: from each step's end to the next's (the whole loop: the batch's fetch and
    collation, the step, its logging), as our published ``steps_per_s`` counts a step; the
    first step's is left out (nothing ends before it)."""
    from transformers import TrainerCallback

    times: list[float] = []

    class StepTimes(TrainerCallback):
        loop_times: list[float] = []  # noqa: RUF012 (one callback a run)
        last_end: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            end = time.perf_counter()
            times.append(end - self.start)
            if self.last_end is not None:
                self.loop_times.append(end - self.last_end)
            self.last_end = end

    return StepTimes(), times


def trl_first_log(trainer: Any) -> dict[str, float]:
    """TRL's step-1 log record (``logging_steps=1``)."""
    return next(r for r in trainer.state.log_history if "loss" in r)


def alternate(kinds: tuple[str, str], rounds: int, run: Callable[[str], dict[str, Any]],
              show: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds of both ``kinds``, their order swapped each round; prints each
    run's ``show`` keys as it ends."""
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            results[kind].append(run(kind))
            row = results[kind][-1]
            print(f"round {r + 1} {kind:5s} " + " | ".join(
                f"{k} {row[k]:.5g}" for k in show if k in row), flush=True)
    return results


def print_ratios(results: dict[str, list[dict[str, Any]]], keys: Sequence[str]) -> None:
    """Median of each key per framework, and ours over TRL's."""
    for key in keys:
        ours, theirs = (statistics.median(r[key] for r in results[k]) for k in ("ours", "trl"))
        print(f"{key}: ours {ours:.4g}, TRL {theirs:.4g}, ours / TRL {ours / theirs:.3f}x "
              f"(medians of {len(results['ours'])} rounds)")


def print_gaps(found: dict[str, float], theirs: dict[str, float], what: str = "step 1") -> None:
    """Each value of ``found`` against TRL's, with the relative gap."""
    for key, value in found.items():
        gap = abs(value - theirs[key]) / max(abs(theirs[key]), 1e-30)
        print(f"{what} {key}: ours {value:.9g}, TRL {theirs[key]:.9g}, gap {gap:.1e}")


def arguments(doc: str, **extra: float) -> argparse.Namespace:
    """The options every comparison takes (rounds, steps, batch, the rate model's size, the
    work directory, the child's role), plus options ``extra`` (name: default, its type the
    default's; ``max_new_tokens`` is ``--max-new-tokens``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    for name, default in {"rounds": 4, "steps": 24, "batch": 8, "hidden": 256, "layers": 4,
                          **extra}.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--child", choices=["ours", "trl"], default=None)
    return parser.parse_args()


def child(a: argparse.Namespace, ours: Callable[[argparse.Namespace], dict[str, Any]],
          trl: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """A throughput child: one intra-op thread, ``ours(a)`` or ``trl(a)``, its RESULT."""
    import torch

    torch.set_num_threads(1)
    print_result((ours if a.child == "ours" else trl)(a))


def throughput_rounds(module: str, a: argparse.Namespace, rate: str | Sequence[str],
                      extra_argv: Sequence[str] = ()) -> None:
    """``a.rounds`` alternated rounds of ``module``'s two children (given ``extra_argv``
    too); the ``rate`` key's (or keys') and the peak RSS's medians and ratios."""
    rates = (rate,) if isinstance(rate, str) else tuple(rate)
    argv = ["--work", str(a.work), "--steps", str(a.steps), "--batch", str(a.batch),
            *extra_argv]
    results = alternate(("ours", "trl"), a.rounds,
                        lambda kind: run_child(module, [*argv, "--child", kind]),
                        show=(*rates, "peak_rss_gib"))
    print_ratios(results, (*rates, "peak_rss_gib"))


def main(doc: str, module: str, rate: str | Sequence[str],
         ours: Callable[[argparse.Namespace], dict[str, Any]],
         trl: Callable[[argparse.Namespace], dict[str, Any]],
         prepare: Callable[[argparse.Namespace, str], None], **extra: float) -> None:
    """A comparison's command line: as a child, `child`; else TRL's version checked, the
    work directory made, ``prepare(a, trl_version)`` (the equal-step checks, the rate runs'
    model and data), then `throughput_rounds`."""
    a = arguments(doc, **extra)
    if a.child is not None:
        child(a, ours, trl)
        return
    version = require_trl()
    a.work = a.work or Path(tempfile.mkdtemp(prefix=module.rsplit(".", 1)[-1] + "_"))
    a.work.mkdir(parents=True, exist_ok=True)
    prepare(a, version)
    throughput_rounds(module, a, rate)
