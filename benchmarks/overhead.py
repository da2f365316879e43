"""What does the `Trainer` cost over a hand-written loop?

    .venv/bin/python -m benchmarks.overhead [--reps N] [--sizes small,large] [--no-memory]

The same MLP classifier, data and optimizer are trained by (each optimizer of ``--optimizers``
in turn: AdamW with ``fused=True``, whose kernel normalises, clips and skips on the device,
and the default AdamW with ``foreach=True``, normalised by foreach ops)

* a minimal loop: forward, mean cross-entropy, backward, ``optimizer.step()``,
  ``zero_grad(set_to_none=True)``;
* the `Trainer` with its defaults: metrics published every 10 steps to JSONL, TensorBoard
  and the console recorder (``recorders=None, progress=True``; the bar is live only on a
  terminal), no validation, ``output_dir`` a temporary directory. Its unit returns
  ``(loss_sum, num_targets)`` with ``num_targets`` a Python int, so both do the same math;
* the loop again, calling torch as the trainer does: the optimizer's step without the
  profiler wrapper torch puts around it when that wrapper has nothing to do
  (`trainer.step.step_call.StepCall`), and ``grad = None`` for each parameter instead of
  ``optimizer.zero_grad(set_to_none=True)``, which goes through ``torch._disable_dynamo`` and
  a profiler range: the trainer/this-loop ratio is the cost the trainer adds, apart from
  what it saves there.

They alternate in one process (``--reps`` short repetitions after a warm-up, the order
flipped every repetition: many short runs rather than a few long ones, so that both see
the same machine). Time is stamped at each batch drawn from the data reader and
cut into windows of 10 steps, aligned so that each trainer window holds one publish. In
each repetition the trainer's median window is divided by the loop's: the printed ratio is
the median of these paired ratios, and the per-step times are the medians over every
window of every repetition, divided by 10. Medians over many short windows are robust to
what shared 2-core machines do to one long run (another process taking the core for a few
milliseconds), and pairing the two runs of a repetition (a fraction of a second apart)
cancels the machine's drift of speed over minutes; the ratio of the pooled medians and the
mean over whole runs are printed beside it. With the 95% confidence interval of that median
ratio (distribution-free: order statistics, from the binomial law of how many values fall
below the true median), taken over the medians of blocks of 10 consecutive pairs rather than
over single pairs: pairs a few seconds apart share the machine's state, and the ratio itself
drifts with it (one 160-pair run here: block medians 1.029-1.096, their spread 1.7x what
independent pairs would give; three invocations within an hour read 1.026, 1.036 and 1.051,
each with a +-1% interval of single pairs). Without ``--reps``, pairs are added until that
interval is within +-1% of the ratio (``--interval``) or ``--max-seconds`` have passed, so a
figure says how far it can be trusted on a noisy machine. The trainer's fixed cost per run (construction, setup,
the last publish, closing recorders) is printed apart. Two sizes: ``small`` (~0.5 ms a step) and ``large`` (~20 ms), with one
intra-op thread by default (``--threads``): on a shared 2-core machine, OpenMP barriers
turn other processes' load into 10x outliers. For memory, each variant of the large size
runs in its own subprocess (peak RSS is monotonic): the peak RSS growth during training,
with the same modules imported first.

The console recorder's lines go to /dev/null (they are still rendered); ``--show-console``
lets them through to the terminal, where the progress bar is live too.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.step.step_call import StepCall
from trainer.trainer import Trainer
from units import MetricBag, TrainUnit

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Size:
    name: str
    batch: int
    inputs: int
    hidden: int
    layers: int  # hidden layers
    classes: int
    steps: int  # per repetition
    reps: int
    target: float  # the trainer/loop ratio we aim for
    own_cost: bool  # also run the loop that calls torch as the trainer does


SIZES = {
    "small": Size("small", batch=96, inputs=128, hidden=256, layers=1, classes=10, steps=300,
                  reps=24, target=1.03, own_cost=True),
    "large": Size("large", batch=176, inputs=512, hidden=1024, layers=2, classes=10, steps=41,
                  reps=30, target=1.01, own_cost=False),
}
NUM_DISTINCT_BATCHES = 16
PUBLISH_EVERY = 10  # the trainer's default publish_metrics_every_n_steps
PAIRS_PER_BLOCK = 10  # the confidence interval is of block medians: see the module docstring


def build_model(size: Size) -> nn.Module:
    torch.manual_seed(0)
    modules: list[nn.Module] = [nn.Linear(size.inputs, size.hidden), nn.ReLU()]
    for _ in range(size.layers - 1):
        modules += [nn.Linear(size.hidden, size.hidden), nn.ReLU()]
    modules.append(nn.Linear(size.hidden, size.classes))
    return nn.Sequential(*modules)


OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}}


def build_optimizer(model: nn.Module, kind: str = "fused") -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **OPTIMIZERS[kind])


def build_batches(size: Size) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size.batch, size.inputs, generator=generator),
         torch.randint(0, size.classes, (size.batch,), generator=generator))
        for _ in range(NUM_DISTINCT_BATCHES)
    ]


class TimedReader:
    """Yields `num_batches` batches (cycling a small pool) and stamps the time of each draw."""

    def __init__(self, batches: list[Batch], num_batches: int) -> None:
        self.batches = batches
        self.num_batches = num_batches
        self.stamps: list[float] = []

    def __iter__(self) -> Iterator[Batch]:
        stamps, batches, pool = self.stamps, self.batches, len(self.batches)
        for i in range(self.num_batches):
            stamps.append(time.perf_counter())
            yield batches[i % pool]

    def per_step_s(self) -> float:
        """Seconds a step, from the first draw to the last (len - 1 complete steps)."""
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)

    def window_step_s(self, window: int = PUBLISH_EVERY) -> list[float]:
        """Seconds a step in each window of `window` steps: draw k*window (the start of step
        k*window + 1) to draw (k+1)*window, which follows the publish of step (k+1)*window."""
        stamps = self.stamps
        return [(stamps[i + window] - stamps[i]) / window
                for i in range(0, len(stamps) - window, window)]


class ClassifierUnit(TrainUnit[Batch]):
    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: Batch, metrics: MetricBag) -> tuple[Tensor, int]:
        x, y = batch
        return F.cross_entropy(self._model(x), y, reduction="sum"), y.shape[0]


def run_loop(model: nn.Module, optimizer: torch.optim.Optimizer, reader: TimedReader) -> None:
    model.train()
    for x, y in reader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_loop_as_trainer(model: nn.Module, optimizer: torch.optim.Optimizer,
                        reader: TimedReader) -> None:
    """The loop, calling torch as the trainer does: the optimizer's step without torch's
    profiler wrapper when it has nothing to do (`StepCall`, ~40-90 us a step at this size),
    and gradients cleared with `param.grad = None` (`optimizer.zero_grad` goes through
    `torch._disable_dynamo` and a profiler range, ~30 us)."""
    model.train()
    step = StepCall(optimizer)
    for x, y in reader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        step()
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None


def run_trainer(model: nn.Module, optimizer: torch.optim.Optimizer, reader: TimedReader,
                show_console: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="gangtrain-overhead-") as output_dir:
        with _console_sink(show_console):
            trainer = Trainer(ClassifierUnit(model), reader, optimizer, output_dir=output_dir,
                              max_num_steps=reader.num_batches, recorders=None, progress=True)
            result = trainer.run()
    if result.num_steps != reader.num_batches:
        raise RuntimeError(f"the trainer ran {result.num_steps} steps, not {reader.num_batches}")


@contextlib.contextmanager
def _console_sink(show_console: bool) -> Iterator[None]:
    if show_console:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def one_run(kind: str, size: Size, batches: list[Batch], steps: int,
            show_console: bool, optimizer_kind: str) -> tuple[list[float], float, float]:
    """(seconds a step in each 10-step window, seconds a step over the whole steady state,
    seconds for the whole run incl. construction)."""
    model = build_model(size)
    optimizer = build_optimizer(model, optimizer_kind)
    reader = TimedReader(batches, steps)
    gc.collect()
    started = time.perf_counter()
    if kind == "trainer":
        run_trainer(model, optimizer, reader, show_console)
    else:
        LOOPS[kind](model, optimizer, reader)
    total = time.perf_counter() - started
    return reader.window_step_s(), reader.per_step_s(), total


LOOPS = {"loop": run_loop, "loop_as_trainer": run_loop_as_trainer}
KINDS = ("loop", "trainer", "loop_as_trainer")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free `confidence` interval of the median of `values`: the order
    statistics (k-th smallest, k-th largest) where k is the largest rank with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None when n is too small (< 6)."""
    n = len(values)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while True:
        below += math.comb(n, k) / 2**n  # P(B <= k)
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def block_medians(values: list[float], block: int = PAIRS_PER_BLOCK) -> list[float]:
    """The medians of consecutive full blocks of `block` values (a last partial block is left
    out): nearly independent samples when neighbouring values share the machine's state."""
    return [statistics.median(values[start:start + block])
            for start in range(0, len(values) - block + 1, block)]


def measure_time(size: Size, reps: int | None, show_console: bool, optimizer_kind: str,
                 interval_target: float = 0.01, max_seconds: float = 300.0) -> None:
    """`reps` pairs of runs; None: at least `size.reps`, then more until the median ratio's
    95% interval is within +-`interval_target` of it, or `max_seconds` have passed."""
    batches = build_batches(size)
    warmup = max(20, size.steps // 5)
    kinds = KINDS if size.own_cost else KINDS[:2]
    for kind in kinds:  # imports, lazy TensorBoard writer, allocator warm-up
        one_run(kind, size, batches, warmup, show_console, optimizer_kind)
    windows: dict[str, list[float]] = {kind: [] for kind in kinds}
    per_step: dict[str, list[float]] = {kind: [] for kind in kinds}
    totals: dict[str, list[float]] = {kind: [] for kind in kinds}
    loops = [kind for kind in kinds if kind != "trainer"]
    paired: dict[str, list[float]] = {kind: [] for kind in loops}  # trainer / loop, per rep
    started = time.perf_counter()

    def more() -> bool:
        done = len(paired["loop"])
        if reps is not None or done < size.reps:
            return done < (reps if reps is not None else size.reps)
        interval = median_interval(block_medians(paired["loop"]))
        wide = interval is None or (interval[1] - interval[0]) / 2 > (
            interval_target * statistics.median(paired["loop"]))
        return wide and time.perf_counter() - started < max_seconds

    rep = -1
    while more():
        rep += 1
        order = kinds if rep % 2 == 0 else kinds[::-1]
        rep_median: dict[str, float] = {}
        for kind in order:
            window_s, step_s, total_s = one_run(kind, size, batches, size.steps, show_console,
                                                optimizer_kind)
            windows[kind] += window_s
            per_step[kind].append(step_s)
            totals[kind].append(total_s)
            rep_median[kind] = statistics.median(window_s)
        for loop in loops:
            paired[loop].append(rep_median["trainer"] / rep_median[loop])
    ms = {kind: statistics.median(windows[kind]) * 1e3 for kind in kinds}
    ratio = statistics.median(paired["loop"])
    blocks = block_medians(paired["loop"])
    interval = median_interval(blocks)
    reps = len(paired["loop"])
    if interval is None:
        trust = f"95% interval: too few pairs ({PAIRS_PER_BLOCK * 6} needed)"
    else:
        half = (interval[1] - interval[0]) / 2 / ratio
        single = median_interval(paired["loop"])
        assert single is not None  # more values than blocks
        single_half = (single[1] - single[0]) / 2 / ratio
        trust = (f"95% interval {interval[0]:.3f}-{interval[1]:.3f}, +-{half:.1%} over "
                 f"{len(blocks)} blocks of {PAIRS_PER_BLOCK} pairs; +-{single_half:.1%} if "
                 "single pairs were independent")
    pooled_ratio = ms["trainer"] / ms["loop"]
    mean_ratio = statistics.median(per_step["trainer"]) / statistics.median(per_step["loop"])
    fixed_ms = statistics.median(
        (t - s * size.steps) - (lt - ls * size.steps)
        for t, s, lt, ls in zip(totals["trainer"], per_step["trainer"], totals["loop"],
                                per_step["loop"])
    ) * 1e3
    approx = "~0.5 ms/step" if size.name == "small" else "~20 ms/step"
    print(f"overhead {size.name} ({approx}), AdamW {optimizer_kind}: loop {ms['loop']:.3f} ms, trainer "
          f"{ms['trainer']:.3f} ms, ratio {ratio:.3f} (target <= {size.target}; {trust}; "
          f"median over "
          f"{reps} reps x {size.steps} steps of the paired ratio of median {PUBLISH_EVERY}-step "
          f"windows; pooled windows {pooled_ratio:.3f}, whole-run means {mean_ratio:.3f})",
          flush=True)
    if size.own_cost:
        own_ratio = statistics.median(paired["loop_as_trainer"])
        print(f"  the trainer's own cost: vs the loop calling torch as the trainer does "
              f"(the step without torch's idle profiler wrapper, grad = None; "
              f"{ms['loop_as_trainer']:.3f} ms): "
              f"ratio {own_ratio:.3f}, {(ms['trainer'] - ms['loop_as_trainer']) * 1e3:+.0f} "
              "us a step", flush=True)
    print(f"  fixed cost per trainer run (construction, setup, last publish, close): "
          f"{fixed_ms:.1f} ms", flush=True)


# -- memory: one subprocess per variant ------------------------------------------------------
def _current_rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def memory_child(kind: str, size_name: str, steps: int) -> None:
    """Runs in a subprocess: prints {"baseline_kib", "peak_kib"} as JSON."""
    import trainer.observe.recorders.event_file  # noqa: F401  (imported by both: library code is not counted)

    size = SIZES[size_name]
    batches = build_batches(size)
    model = build_model(size)
    optimizer = build_optimizer(model)
    reader = TimedReader(batches, steps)
    gc.collect()
    baseline = _current_rss_kib()
    if kind == "loop":
        run_loop(model, optimizer, reader)
    else:
        run_trainer(model, optimizer, reader, show_console=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak}))


def measure_memory(size: Size, steps: int, reps: int) -> None:
    growth: dict[str, list[int]] = {"loop": [], "trainer": []}
    peaks: dict[str, list[int]] = {"loop": [], "trainer": []}
    for rep in range(reps):
        order = ("loop", "trainer") if rep % 2 == 0 else ("trainer", "loop")
        for kind in order:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.overhead", "--memory-child", kind,
                 "--sizes", size.name, "--memory-steps", str(steps)],
                check=True, capture_output=True, text=True,
            ).stdout
            values = json.loads(out.strip().splitlines()[-1])
            growth[kind].append(values["peak_kib"] - values["baseline_kib"])
            peaks[kind].append(values["peak_kib"])
    loop_mib = statistics.median(growth["loop"]) / 1024
    trainer_mib = statistics.median(growth["trainer"]) / 1024
    loop_peak = statistics.median(peaks["loop"]) / 1024
    trainer_peak = statistics.median(peaks["trainer"]) / 1024
    print(f"memory {size.name} (peak RSS growth during {steps} steps, own subprocess each, "
          f"median of {reps}): loop {loop_mib:.1f} MiB, trainer {trainer_mib:.1f} MiB, "
          f"ratio {trainer_mib / loop_mib:.3f} (target <= 1.05); whole-process peak RSS "
          f"ratio {trainer_peak / loop_peak:.3f} ({loop_peak:.0f} vs {trainer_peak:.0f} MiB)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per "
                        "variant (default: at least 24 small, 30 large, then more until the "
                        "interval is narrow enough)")
    parser.add_argument("--interval", type=float, default=0.01,
                        help="wanted half-width of the ratio's 95%% interval (default +-1%%)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="time cap for adding repetitions, per size and optimizer")
    parser.add_argument("--sizes", default="small,large", help="comma-separated: small,large")
    parser.add_argument("--steps", type=int, default=None, help="steps a repetition "
                        "(default: 300 small, 41 large: 4 windows)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--optimizers", default="fused,foreach",
                        help="comma-separated AdamW kinds: fused,foreach")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory figure")
    parser.add_argument("--memory-reps", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=40)
    parser.add_argument("--show-console", action="store_true",
                        help="let the console recorder write to stdout (a live bar on a tty)")
    parser.add_argument("--memory-child", choices=("loop", "trainer"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")

    if args.memory_child:
        memory_child(args.memory_child, names[0], args.memory_steps)
        return

    print(f"optimizers: AdamW {args.optimizers} (the same for loop and trainer); torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; trainer with default "
          f"recorders (JSONL, TensorBoard, console{'' if args.show_console else ' to /dev/null'})"
          f", publish every 10 steps, no validation", flush=True)
    for name in names:
        size = SIZES[name]
        if args.steps is not None:
            size = Size(**{**size.__dict__, "steps": args.steps})
        for optimizer_kind in args.optimizers.split(","):
            measure_time(size, args.reps, args.show_console, optimizer_kind,
                         args.interval, args.max_seconds)
    if not args.no_memory and "large" in names:
        measure_memory(SIZES["large"], args.memory_steps, args.memory_reps)


if __name__ == "__main__":
    main()
