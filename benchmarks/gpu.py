"""On one GPU: the `Trainer` against a hand-written loop, MFU, memory, and host syncs a step.

    python -m benchmarks.gpu [--preset gpu] [--reps 5] [--warmup 10] [--steps 30]
        [--variants eager,compiled] [--out PATH] [--set model.dim=1024 ...]
    python -m benchmarks.gpu --device cpu --preset tiny --variants eager [--out PATH]

The model is the `recipes.lm` GPT of a preset (default ``gpu``: 85M parameters, 32 x 1024
tokens a step, bf16 autocast, AdamW as the recipe builds it, fused; clipping at 1.0), with
the preset's trainer settings (dtype, accumulation, clipping, publish interval); no
validation, no checkpoints. Two sides train the SAME model object with the SAME optimizer
on the SAME batches (random tokens made on the device up front):

* the `Trainer`, with the stock `CausalLMUnit` (summed loss and target count), recording
  JSONL and TensorBoard to a temporary directory (the console is off);
* a hand-written loop: autocast forward, mean cross-entropy, backward,
  ``clip_grad_norm_(foreach=True)``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
  it keeps its losses on the device and reads them (with the gradient norm) once every
  ``publish_metrics_every_n_steps`` steps, as the trainer publishes.

Each repetition runs both, one after the other, the order flipped every repetition; each
run draws ``--warmup`` untimed steps, then ``--steps`` timed ones (the clock starts at the
first timed batch and stops when the run has returned, after a device synchronisation at
both ends: the trainer's last publish and the loop's last read are inside). The printed
ratio is the median over the repetitions of trainer time / loop time (target <= 1.01).
``compiled`` runs the same after ``model.compile()``, which is what ``compile_model=True``
does to a model that no DDP wraps (the trainer compiles the module inside DDP, never the
wrapper); compiling once serves both sides, and an untimed loop run first takes the
compilation.

MFU = tokens/s x ``gangtrain.models.gpt.model.flops_per_token`` / the device's dense peak for the
dtype (``trainer.observe.system_metrics.peak_flops``: H100 SXM and H200 989 TFLOP/s bf16).
Peak memory is ``torch.cuda.max_memory_allocated`` of each run.

Host syncs: one more Trainer run (eager) whose unit is a `SyncCheckedUnit`: torch's CUDA
sync debug mode is on ("warn") for every step that does not end at a sync point (publish),
and the warnings it gives are counted: ``host_syncs_per_step`` is their number over the
steps checked (0 when the run is clean). Like torch's mode, it sees the syncs that go through
``memcpy_and_sync`` or a stream synchronisation (``.item()``, ``.cpu()``, ``bool(t)``,
``nonzero``...), not an explicit ``torch.cuda.synchronize()``. ``tests/test_gpu`` proves the
same with the mode set to "error".

On a GPU the figures go to ``benchmarks/results/gpu.json`` (or ``--out``). Without CUDA it
exits 1 with one line, unless asked for the CPU smoke run (``--device cpu --preset tiny``),
which writes only where ``--out`` says and never to ``benchmarks/results/gpu.json``: CPU
and GPU figures are never mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.lm_throughput import (
    Batch,
    SyntheticReader,
    gpt_config_from,
    peak_flops,
    synthetic_pool,
)
from gangs import FakeGang, Gangs, setup_gangs
from gangtrain.app import TrainerConfig
from gangtrain.app.cli import load_config
from gangtrain.models.gpt.model import GPT, GPTConfig, flops_per_token, num_parameters
from recipes.lm.config import PRESETS, LMConfig
from trainer.errors import UserError
from trainer.observe.recorders import JsonlRecorder, TensorBoardRecorder
from units import MetricBag, TrainUnit
from units.causal_lm import CausalLMUnit

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text, in "warn" and "error"
TARGET_RATIO = 1.01
VARIANTS = ("eager", "compiled")
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

SyncDebugMode = Literal["error", "warn"]


# -- host syncs ----------------------------------------------------------------------------
class SyncCheckedUnit(TrainUnit[Batch]):
    """A unit that runs the steps between sync points under torch's CUDA sync debug mode.

    The trainer calls `set_step_nr` before each step. Steps from `first_checked_step` on
    run with ``torch.cuda.set_sync_debug_mode(mode)``, except those that end at a sync point
    (multiples of `sync_every_n_steps`: the trainer reads its metrics there) and the last
    one (`num_steps`: the run ends with a publish); those run with the mode off. In "error"
    mode a synchronising call in a checked step raises ``RuntimeError("called a
    synchronizing CUDA operation")``; in "warn" mode it warns with that text. `mode=None`
    changes nothing and only records the schedule (on a device without the mode).

    `checked_steps` lists the steps run checked. Use it as a context manager, or call
    `close()`: the mode is global to the process and is turned off at the end.
    """

    def __init__(self, unit: TrainUnit[Batch], *, sync_every_n_steps: int, num_steps: int,
                 mode: SyncDebugMode | None, first_checked_step: int = 2) -> None:
        if sync_every_n_steps < 1 or first_checked_step < 1:
            raise ValueError("sync_every_n_steps and first_checked_step must be >= 1")
        self.unit = unit
        self.sync_every_n_steps = sync_every_n_steps
        self.num_steps = num_steps
        self.mode = mode
        self.first_checked_step = first_checked_step
        self.steps_seen: list[int] = []
        self.checked_steps: list[int] = []

    @property
    def model(self) -> nn.Module:
        return self.unit.model

    def __call__(self, batch: Batch, metrics: MetricBag) -> tuple[Tensor, int | Tensor | None]:
        return self.unit(batch, metrics)

    def derive_metrics(self, values: dict[str, float]) -> None:
        self.unit.derive_metrics(values)

    def is_checked(self, step_nr: int) -> bool:
        """Whether step `step_nr` runs under the sync debug mode."""
        return (self.first_checked_step <= step_nr < self.num_steps
                and step_nr % self.sync_every_n_steps != 0)

    def set_step_nr(self, step_nr: int) -> None:
        self.unit.set_step_nr(step_nr)
        self.steps_seen.append(step_nr)
        checked = self.is_checked(step_nr)
        if checked:
            self.checked_steps.append(step_nr)
        self._set_mode(self.mode if checked else None)

    def close(self) -> None:
        """Turn the sync debug mode off."""
        self._set_mode(None)

    def __enter__(self) -> SyncCheckedUnit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _set_mode(self, mode: SyncDebugMode | None) -> None:
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode(mode or "default")


def count_host_syncs(model: nn.Module, optimizer: torch.optim.Optimizer, pool: list[Batch],
                     trainer_config: TrainerConfig, gangs: Gangs,
                     num_steps: int) -> tuple[int, int]:
    """(synchronising calls, steps checked) in `num_steps` Trainer steps, the steps between
    sync points run under the sync debug mode "warn" (see `SyncCheckedUnit`)."""
    config = trainer_config.model_copy(update={"max_num_steps": num_steps})
    batches = [pool[i % len(pool)] for i in range(num_steps * config.num_accumulate)]
    checked_unit = SyncCheckedUnit(CausalLMUnit(model, bytes_per_token=1),
                                   sync_every_n_steps=config.publish_metrics_every_n_steps,
                                   num_steps=num_steps, mode="warn")
    with (tempfile.TemporaryDirectory(prefix="gangtrain-gpu-syncs-") as output_dir,
          warnings.catch_warnings(record=True) as caught, checked_unit):
        warnings.simplefilter("always")
        config.build(checked_unit, batches, optimizer, output_dir=output_dir, gangs=gangs,
                     resume=False, recorders=[]).run()
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    return syncs, len(checked_unit.checked_steps)


# -- the two sides -------------------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    """What both sides share: the model, its optimizer, the batches, the settings."""

    model: GPT
    optimizer: torch.optim.Optimizer
    pool: list[Batch]
    trainer_config: TrainerConfig  # the preset's, validation and checkpoints off
    gangs: Gangs
    warmup: int
    steps: int

    @property
    def device(self) -> torch.device:
        return self.gangs.device

    @property
    def num_steps(self) -> int:
        return self.warmup + self.steps

    def reader(self) -> SyntheticReader:
        """The micro-batches of one run; the clock starts at the first timed step's."""
        per_step = self.trainer_config.num_accumulate
        return SyntheticReader(self.pool, self.num_steps * per_step, self.warmup * per_step,
                               self.device)


@dataclass(frozen=True)
class Run:
    seconds: float  # the timed steps
    peak_memory_gib: float | None  # CUDA only


def run_trainer(bench: Bench) -> Run:
    """One Trainer run of `bench.num_steps` steps, the last `bench.steps` timed."""
    reader = bench.reader()
    config = bench.trainer_config.model_copy(update={"max_num_steps": bench.num_steps})
    _reset_peak_memory(bench.device)
    with tempfile.TemporaryDirectory(prefix="gangtrain-gpu-") as output_dir:
        recorders = [JsonlRecorder(Path(output_dir)), TensorBoardRecorder(Path(output_dir) / "tb")]
        trainer = config.build(CausalLMUnit(bench.model, bytes_per_token=1), reader,
                               bench.optimizer, output_dir=output_dir, gangs=bench.gangs,
                               resume=False, recorders=recorders)
        result = trainer.run()
        _synchronize(bench.device)
        ended = time.perf_counter()
    if result.num_steps != bench.num_steps or reader.started is None:
        raise RuntimeError(f"the trainer ran {result.num_steps} of {bench.num_steps} steps "
                           f"({result.stop_reason})")
    return Run(ended - reader.started, _peak_memory_gib(bench.device))


def run_loop(bench: Bench) -> Run:
    """The same steps, hand-written (see the module's docstring)."""
    reader = bench.reader()
    _reset_peak_memory(bench.device)
    hand_written_loop(bench.model, bench.optimizer, reader, bench.trainer_config, bench.device)
    _synchronize(bench.device)
    ended = time.perf_counter()
    if reader.started is None:
        raise RuntimeError("the loop ended before its timed steps")
    return Run(ended - reader.started, _peak_memory_gib(bench.device))


def hand_written_loop(model: nn.Module, optimizer: torch.optim.Optimizer,
                      batches: Iterable[Batch], settings: TrainerConfig,
                      device: torch.device) -> list[float]:
    """Train on `batches`, `settings.num_accumulate` micro-batches a step, as a careful user
    writes it: mean loss, clipping, no host read but every `publish_metrics_every_n_steps`
    steps and at the end. Returns the mean loss of each window read."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    dtype = _AUTOCAST[settings.dtype] if settings.amp else None
    clip = settings.max_gradient_norm
    model.train()
    pending: list[Tensor] = []  # this window's losses, on the device
    norm: Tensor | None = None  # the last step's gradient norm, read with them
    window_means: list[float] = []
    micro_batches: Iterator[Batch] = iter(batches)
    step_nr = 0
    while window := list(islice(micro_batches, settings.num_accumulate)):
        step_nr += 1
        for batch in window:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, -2).float(),
                                       batch["target_ids"].flatten())
            (loss / len(window)).backward()
            pending.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True) if clip else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step_nr % settings.publish_metrics_every_n_steps == 0:
            window_means.append(_read_window(pending, norm))
    if pending:
        window_means.append(_read_window(pending, norm))
    return window_means


def _read_window(pending: list[Tensor], norm: Tensor | None) -> float:
    """One host read of the window's losses (and the last gradient norm); clears them."""
    values = torch.stack(pending + ([norm.float()] if norm is not None else [])).tolist()
    count = len(pending)
    pending.clear()
    return sum(values[:count]) / count


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# -- one variant: interleaved repetitions -------------------------------------------------
@dataclass(frozen=True)
class VariantResult:
    name: str
    loop: list[Run]
    trainer: list[Run]

    @property
    def ratios(self) -> list[float]:
        """Trainer time / loop time of each repetition."""
        return [t.seconds / loop.seconds for t, loop in zip(self.trainer, self.loop)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def seconds_per_step(self, side: Literal["loop", "trainer"], steps: int) -> float:
        return statistics.median(run.seconds for run in getattr(self, side)) / steps

    def peak_memory_gib(self, side: Literal["loop", "trainer"]) -> float | None:
        peaks = [run.peak_memory_gib for run in getattr(self, side)]
        return None if None in peaks else max(peaks)  # type: ignore[type-var]


def measure(bench: Bench, name: str, reps: int) -> VariantResult:
    """`reps` repetitions of the loop and the trainer, the order flipped each time, after
    one untimed loop run (compilation, allocator, optimizer state)."""
    run_loop(bench)
    loops: list[Run] = []
    trainers: list[Run] = []
    for rep in range(reps):
        if rep % 2 == 0:
            loops.append(run_loop(bench))
            trainers.append(run_trainer(bench))
        else:
            trainers.append(run_trainer(bench))
            loops.append(run_loop(bench))
    return VariantResult(name, loops, trainers)


# -- the command ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override, as the recipe's --set")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the code paths, with --preset tiny only")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each variant")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of each run")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each run")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--sync-steps", type=int, default=30,
                        help="steps of the host-sync count run (CUDA only)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the JSON results (default on CUDA: {RESULTS}; on the CPU: none)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m benchmarks.gpu", *(sys.argv[1:] if argv is None else argv)])
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    if args.reps < 1 or args.steps < 1 or args.warmup < 0 or args.sync_steps < 1:
        parser.error("--reps, --steps and --sync-steps must be >= 1, --warmup >= 0")
    return args


def _check_device(args: argparse.Namespace) -> str | None:
    """Why this command cannot run as asked (one line), or None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("error: no CUDA device: benchmarks.gpu measures a GPU "
                "(a CPU smoke run of its code: --device cpu --preset tiny)")
    if args.device == "cpu" and args.preset != "tiny":
        return "error: --device cpu is a smoke run: use it with --preset tiny"
    if args.device == "cpu" and args.out is not None and args.out.resolve() == RESULTS:
        return f"error: CPU figures never go to {RESULTS} (it holds GPU figures)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = _check_device(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1 if args.device == "cuda" else 2
    try:
        config = load_config(LMConfig, PRESETS, args.preset, overrides=args.overrides)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if config.trainer.dtype == "fp16":
        print("error: trainer.dtype fp16: the hand-written loop has no loss scaler to match the "
              "trainer's; use bf16 or fp32", file=sys.stderr)
        return 2

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    bench = _build(config, device, args.warmup, args.steps)
    settings = bench.trainer_config
    gpt_config: GPTConfig = bench.model.config
    tokens_per_step = config.data.batch_size * config.data.seq_len * settings.num_accumulate
    device_name, peak = peak_flops(device, settings.dtype)
    print(f"gpu bench {args.preset}: {num_parameters(bench.model) / 1e6:.2f}M parameters, "
          f"{tokens_per_step} tokens a step, {settings.dtype}, accumulate "
          f"{settings.num_accumulate}, clip {settings.max_gradient_norm}, AdamW(fused="
          f"{config.optimizer.fused}), device {device_name}, torch {torch.__version__}; "
          f"{args.reps} x ({args.warmup} + {args.steps} steps) a side", flush=True)

    results: dict[str, VariantResult] = {}
    syncs: tuple[int, int] | None = None
    for name in args.variants:
        if name == "compiled":
            bench.model.compile()  # what Trainer(compile_model=True) does to an unwrapped model
        results[name] = measure(bench, name, args.reps)
        _print_variant(results[name], args.steps, tokens_per_step, gpt_config, peak,
                       device_name, settings.dtype)
        if name == "eager" and device.type == "cuda":
            syncs = count_host_syncs(bench.model, bench.optimizer, bench.pool, settings,
                                     bench.gangs, args.sync_steps)
            print(f"host syncs: {syncs[0]} in {syncs[1]} steps checked "
                  f"({syncs[0] / max(syncs[1], 1):.2f} a step; torch.cuda sync debug mode "
                  f"'warn' on every step but publish steps and the first)", flush=True)
    if device.type != "cuda":
        print("host syncs: not measured (CUDA's sync debug mode only)", flush=True)

    out = args.out if args.out is not None else (RESULTS if device.type == "cuda" else None)
    if out is not None:
        record = _record(results, syncs, device_name, args, tokens_per_step, gpt_config, peak)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"results: {out}", flush=True)
    return 0


def _build(config: LMConfig, device: torch.device, warmup: int, steps: int) -> Bench:
    """The model, optimizer and batches of `config`, and its trainer settings for a
    benchmark: no validation, checkpoints, early stopping, progress bar or W&B."""
    gpt_config = gpt_config_from(config)
    torch.manual_seed(config.trainer.seed)
    with torch.device(device):
        model = GPT(gpt_config)
    optimizer = config.optimizer.build(model)
    pool = synthetic_pool(gpt_config.vocab_size, config.data.batch_size, config.data.seq_len,
                          device)
    trainer_config = config.trainer.model_copy(update={
        "max_num_data_epochs": None, "validate_every_n_steps": None,
        "validate_at_start": False, "validate_at_end": False, "checkpoint_every_n_steps": None,
        "keep_last_n_checkpoints": None, "keep_best_n_checkpoints": None,
        "score_metric": None, "early_stopper": None, "compile_model": False,
        "progress": False, "wandb_project": None,
    })
    gangs = setup_gangs(FakeGang(device=device))
    return Bench(model, optimizer, pool, trainer_config, gangs, warmup, steps)


def _mfu(tokens_per_s: float, gpt_config: GPTConfig, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s * flops_per_token(gpt_config) / peak


def _print_variant(result: VariantResult, steps: int, tokens_per_step: int,
                   gpt_config: GPTConfig, peak: float | None, device_name: str,
                   dtype: str) -> None:
    loop_s = result.seconds_per_step("loop", steps)
    trainer_s = result.seconds_per_step("trainer", steps)
    runs = ", ".join(f"{r:.3f}" for r in result.ratios)  # in repetition order
    print(f"{result.name}: loop {loop_s * 1e3:.2f} ms/step ({tokens_per_step / loop_s:,.0f} "
          f"tokens/s), trainer {trainer_s * 1e3:.2f} ms/step "
          f"({tokens_per_step / trainer_s:,.0f} tokens/s): trainer/loop ratio "
          f"{result.ratio:.3f} (target <= {TARGET_RATIO}; runs: {runs})", flush=True)
    mfu = _mfu(tokens_per_step / trainer_s, gpt_config, peak)
    if mfu is None or peak is None:
        mfu_text = "MFU n/a (no peak known for this device)"
    else:
        mfu_text = (f"MFU {mfu:.1%} (trainer) of {device_name} {dtype} dense peak "
                    f"{peak / 1e12:.0f} TFLOP/s")
    memory = result.peak_memory_gib("trainer"), result.peak_memory_gib("loop")
    memory_text = ("peak memory n/a on the CPU" if None in memory else
                   f"peak memory trainer {memory[0]:.2f} GiB, loop {memory[1]:.2f} GiB")
    print(f"{result.name}: {mfu_text}; {memory_text}", flush=True)


def _record(results: dict[str, VariantResult], syncs: tuple[int, int] | None,
            device_name: str, args: argparse.Namespace, tokens_per_step: int,
            gpt_config: GPTConfig, peak: float | None) -> dict[str, Any]:
    """The JSON of `benchmarks/results/gpu.json` (see benchmarks/results/README.md)."""
    def per_side(value: Any) -> dict[str, Any]:
        return {name: {side: value(result, side) for side in ("trainer", "loop")}
                for name, result in results.items()}

    tokens_per_s = per_side(lambda r, side: tokens_per_step / r.seconds_per_step(side,
                                                                                 args.steps))
    mfu = {name: _mfu(sides["trainer"], gpt_config, peak)
           for name, sides in tokens_per_s.items()}
    return {
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": args.command,
        "preset": args.preset,
        "overrides": args.overrides,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token(gpt_config),
        "peak_flops": peak,
        "tokens_per_s": tokens_per_s,
        "mfu_eager": mfu.get("eager"),
        "mfu_compiled": mfu.get("compiled"),
        "trainer_over_loop": {name: r.ratio for name, r in results.items()},
        "trainer_over_loop_runs": {name: r.ratios for name, r in results.items()},
        "host_syncs_per_step": None if syncs is None else syncs[0] / max(syncs[1], 1),
        "host_syncs_steps_checked": None if syncs is None else syncs[1],
        "peak_memory_gib": per_side(lambda r, side: r.peak_memory_gib(side)),
    }


if __name__ == "__main__":
    sys.exit(main())
