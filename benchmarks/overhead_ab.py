"""What one piece of the trainer costs a step, to a few microseconds.

    .venv/bin/python -m benchmarks.overhead_ab [EXPERIMENT ...] [--runs N] [--steps N]

`benchmarks.overhead` compares whole runs: on this 2-core VM two runs a second apart differ
by 1-3% (10-20 us a step at the small size), so a change worth 2-5 us cannot be seen there.
Here one trainer run (the small size of `benchmarks.overhead`, AdamW fused) switches one
function between its real version (A) and an alternative (B) every 10-step window, aligned
so that each window holds one publish, and the median step of the B windows is compared
with that of the A windows of the same run: the machine's drift cancels between windows a
few milliseconds apart. Printed: the median over `--runs` runs of B - A in microseconds a
step, with the smallest and largest run; two identical versions (`same`) give about
0 +- 5 us.

Most alternatives leave a piece out (no publish, no gradient norm for the record): the run
is then not a correct training run, only a measure of what that piece costs in place, where
code runs cold after each backward (several times its cost in a tight loop).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks import overhead as bench
from trainer.observe.system_metrics import SystemMetrics
from trainer.step import forward_backward, gradients, step_log
from trainer.step.optimizer_step import StepOutcome
from trainer.step.step_call import StepCall
from trainer.trainer import Trainer

WINDOW = bench.PUBLISH_EVERY


class _Switch:
    """Which version runs now: B in every other window of steps."""

    use_alternative = False


class AlternatingReader(bench.TimedReader):
    """`TimedReader` that switches to B at the first draw of every other window."""

    def __iter__(self) -> Iterator[bench.Batch]:
        stamps, pool = self.stamps, len(self.batches)
        for i in range(self.num_batches):
            stamps.append(time.perf_counter())
            _Switch.use_alternative = (i // WINDOW) % 2 == 1
            yield self.batches[i % pool]


def _item_reads(tensors: list[torch.Tensor]) -> list[float]:
    return [tensor.item() for tensor in tensors]


def _minimal_step(trainer: Trainer, batches: list[Any]) -> None:
    """Forward, backward from the mean seed, step, clear: what a hand-written loop does, with
    the step called as the trainer calls it (so B - A is the bookkeeping alone)."""
    loss, num_targets = trainer.unit(batches[0], trainer.metrics)
    loss.backward(gradients.mean_seed(num_targets, loss))
    trainer.optimizer_step.step_call()
    trainer.steps.log(trainer.state.step_nr, loss.detach(), num_targets,
                      StepOutcome(skipped=False))
    trainer.optimizer_step.clear_gradients()


# name: (owner, attribute, alternative, what B - A tells)
EXPERIMENTS: dict[str, tuple[Any, str, Callable[..., Any], str]] = {
    "same": (Trainer, "_sync_point", Trainer._sync_point, "nothing: the noise floor"),
    "publish": (Trainer, "_sync_point", lambda self, due, stop: None,
                "minus the cost of the sync point (publishing every 10 steps)"),
    "record_norm": (gradients, "gradient_norm_parts", lambda params, *split: [],
                    "minus the gradient norm measured for the record on publish steps"),
    "system_metrics": (SystemMetrics, "publish", lambda self, *args: {},
                       "minus the system metrics of a publish"),
    "unit_checks": (forward_backward, "check_unit_output", lambda unit, loss, count, step: count,
                    "minus the check of the unit's output"),
    "minimal_step": (Trainer, "_train_step", _minimal_step,
                     "minus the step's bookkeeping over a hand-written step"),
    "cpu_item_reads": (step_log, "_to_host", _item_reads,
                       "a publish reading CPU values with .item() instead of one stack op"),
    "wrapped_step": (StepCall, "__call__", lambda self: self.optimizer.step(),
                     "optimizer.step() through torch's profiler wrapper, always"),
}


def measure(name: str, runs: int, steps: int) -> None:
    owner, attribute, alternative, meaning = EXPERIMENTS[name]
    real = getattr(owner, attribute)

    def switched(*args: Any, **kwargs: Any) -> Any:
        return (alternative if _Switch.use_alternative else real)(*args, **kwargs)

    size = bench.SIZES["small"]
    batches = bench.build_batches(size)
    setattr(owner, attribute, switched)
    try:
        differences = []
        for run in range(runs + 1):  # the first warms up
            model = bench.build_model(size)
            optimizer = bench.build_optimizer(model, "fused")
            reader = AlternatingReader(batches, steps)
            bench.run_trainer(model, optimizer, reader, show_console=False)
            windows = reader.window_step_s(WINDOW)
            a, b = windows[0::2], windows[1::2]
            if run > 0:
                differences.append((statistics.median(b) - statistics.median(a)) * 1e6)
    finally:
        setattr(owner, attribute, real)
    differences.sort()
    print(f"{name:15s} B - A {statistics.median(differences):+6.1f} us a step (runs "
          f"{differences[0]:+.1f}..{differences[-1]:+.1f}): {meaning}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", metavar="EXPERIMENT",
                        help=f"default: all of {', '.join(EXPERIMENTS)}")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3000, help="steps a run")
    args = parser.parse_args()
    unknown = [name for name in args.experiments if name not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiment(s) {unknown}; choose from {', '.join(EXPERIMENTS)}")
    torch.set_num_threads(1)
    for name in args.experiments or EXPERIMENTS:
        measure(name, args.runs, args.steps)


if __name__ == "__main__":
    main()
