"""Instructions a training step costs, counted by valgrind's callgrind: load-independent.

    .venv/bin/python -m benchmarks.overhead_instructions [REV ...] [--steps 100,300]
        [--kind trainer|loop|loop_as_trainer] [--top 25]

On a shared machine a timed ratio moves with what other processes do to the caches; the
count of instructions a step executes does not. For this tree and each git revision REV
(checked out into a temporary worktree), the small size of `benchmarks.overhead` (fused
AdamW, one thread) runs twice under `valgrind --tool=callgrind`, for the two step counts of
`--steps`; the difference of the two totals, divided by the difference of the step counts,
is the instructions of one step (construction, imports and the last publish cancel out).
With `--top`, the functions whose per-step count differs most between the first tree and
this one. Slow: about 3-10 minutes a run (the runs of a tree go in parallel, one core each).
Instructions are not time (a cache miss costs more than an add), so a timed check stays
`benchmarks.overhead_trees`; this one says where a difference comes from.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One run: the small size's model, data and optimizer, `steps` steps of `kind`.
RUN = """
import sys, torch
torch.set_num_threads(1)
from benchmarks import overhead as o
kind, steps = sys.argv[1], int(sys.argv[2])
size = o.SIZES["small"]
model = o.build_model(size)
optimizer = o.build_optimizer(model, "fused")
reader = o.TimedReader(o.build_batches(size), steps)
if kind == "trainer":
    o.run_trainer(model, optimizer, reader, show_console=False)
else:
    o.LOOPS[kind](model, optimizer, reader)
"""


def callgrind(tree: Path, kind: str, steps: int, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree)])}
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes",
         f"--callgrind-out-file={out}", sys.executable, "-c", RUN, kind, str(steps)],
        cwd=tree, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def by_function(out: Path) -> collections.Counter[str]:
    """Instructions by function (and "TOTAL") of the main thread in one callgrind output
    (the step runs there; idle BLAS/OpenMP threads spin by the clock, not by the step)."""
    main_thread = out.with_name(out.name + "-01")
    text = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=no",
                           str(main_thread)],
                          capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        match = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line)
        if match:
            name = "TOTAL" if "PROGRAM TOTALS" in line else re.sub(
                r"'\d+", "", match.group(2).split(" [")[0])
            counts[name] += int(match.group(1).replace(",", ""))
    return counts


def per_step(tree: Path, kind: str, steps: tuple[int, int], tmp: Path) -> dict[str, float]:
    outs = [tmp / f"{tree.name}-{kind}-{n}.out" for n in steps]
    runs = [callgrind(tree, kind, n, out) for n, out in zip(steps, outs)]
    for run in runs:
        if run.wait() != 0:
            raise SystemExit(f"valgrind failed in {tree} (rc {run.returncode})")
    low, high = (by_function(out) for out in outs)
    return {name: (high[name] - low[name]) / (steps[1] - steps[0]) for name in low | high}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="other trees: git revisions of this repository")
    parser.add_argument("--steps", default="100,300")
    parser.add_argument("--kind", default="trainer",
                        choices=("trainer", "loop", "loop_as_trainer"))
    parser.add_argument("--top", type=int, default=0)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    low, high = (int(n) for n in args.steps.split(","))
    with tempfile.TemporaryDirectory(prefix="overhead-instructions-") as tmp_name:
        tmp = Path(tmp_name)
        trees = {}
        for rev in args.revs:
            trees[rev] = tmp / f"tree-{len(trees)}"
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[rev]), rev],
                           cwd=ROOT, check=True)
        trees["this tree"] = ROOT
        try:
            counts = {name: per_step(tree, args.kind, (low, high), tmp)
                      for name, tree in trees.items()}
        finally:
            for rev in args.revs:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[rev])],
                               cwd=ROOT, check=False)
    for name, table in counts.items():
        print(f"{name}: {table['TOTAL']:,.0f} instructions a step ({args.kind}, small, "
              f"steps {low} -> {high})")
    if args.top and len(counts) > 1:
        first, this = next(iter(counts.values())), counts["this tree"]
        names = sorted(set(first) | set(this) - {"TOTAL"},
                       key=lambda n: -abs(this.get(n, 0) - first.get(n, 0)))
        print(f"largest differences, this tree - {next(iter(counts))} (a step):")
        for name in names[:args.top]:
            print(f"{this.get(name, 0) - first.get(name, 0):+12,.0f}  {name[:140]}")


if __name__ == "__main__":
    main()
