"""`benchmarks.overhead` on two trees of the project, in one run, side by side.

    .venv/bin/python -m benchmarks.overhead_trees REV [--rounds 2] [overhead options...]

A restructuring must not make the step slower. This checks out REV (a commit, tag or branch)
into a temporary git worktree and runs `benchmarks.overhead` there and in this tree in turn,
`--rounds` times each (the order flipped every round, so that both see the same machine), with
the same options and this interpreter. Each run's ratio is the trainer against a hand-written
loop measured in the same process, so the two trees' ratios compare even when the machine's
speed drifts between runs. It prints each run's ratio and 95% interval, then both trees'
medians.

`--cpu-clock`: every clock the benchmark reads (its window stamps, the trainer's) is this
thread's CPU time (`time.thread_time`) instead of the wall clock. With one intra-op thread
the step runs on this thread, so time the process spends waiting for a core on a loaded
machine is left out of both the trainer's and the loop's figures (what a shared machine's
other processes do to caches is not).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIO = re.compile(r"overhead (\w+) \(.*?\), AdamW (\w+): .* ratio (\d+\.\d+) \(target <= [\d.]+; "
                   r"95% interval:? (?:(\d+\.\d+)-(\d+\.\d+)|too few)")


# `python -m benchmarks.overhead`, its clocks reading this thread's CPU time.
CPU_CLOCK_RUN = ("import runpy, sys, time; time.perf_counter = time.thread_time; "
                 "sys.argv[0] = 'benchmarks.overhead'; "
                 "runpy.run_module('benchmarks.overhead', run_name='__main__')")


def run_overhead(tree: Path, options: list[str], cpu_clock: bool = False
                 ) -> dict[str, tuple[float, float, float]]:
    """One `benchmarks.overhead` run in `tree`: {"small/fused": (ratio, low, high), ...}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree)])}
    run = ["-c", CPU_CLOCK_RUN] if cpu_clock else ["-m", "benchmarks.overhead"]
    out = subprocess.run([sys.executable, *run, "--no-memory", *options],
                         cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    figures = {}
    for line in out.splitlines():
        match = RATIO.search(line)
        if match:
            size, optimizer, ratio, low, high = match.groups()
            figures[f"{size}/{optimizer}"] = (float(ratio), float(low or "nan"),
                                              float(high or "nan"))
    if not figures:
        raise SystemExit(f"no ratio in the output of {tree}:\n{out}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the other tree: a git revision of this repository")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time by this thread's CPU time (a loaded machine)")
    args, options = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="overhead-tree-") as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.rev],
                       cwd=ROOT, check=True)
        try:
            trees = {args.rev: other, "this tree": ROOT}
            results: dict[str, list[dict]] = {name: [] for name in trees}
            for round_nr in range(args.rounds):
                order = list(trees) if round_nr % 2 == 0 else list(trees)[::-1]
                for name in order:
                    figures = run_overhead(trees[name], options, args.cpu_clock)
                    results[name].append(figures)
                    shown = ", ".join(f"{key} {r:.3f} ({lo:.3f}-{hi:.3f})"
                                      for key, (r, lo, hi) in figures.items())
                    print(f"round {round_nr + 1} {name}: {shown}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT,
                           check=False)
    keys = sorted(results["this tree"][0])
    for key in keys:
        medians = {name: statistics.median(run[key][0] for run in runs)
                   for name, runs in results.items()}
        print(f"{key}: {args.rev} {medians[args.rev]:.3f}, this tree "
              f"{medians['this tree']:.3f}, this/other {medians['this tree'] / medians[args.rev]:.3f}")


if __name__ == "__main__":
    main()
