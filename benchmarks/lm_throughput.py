"""Training throughput of the `recipes.lm` GPT through the `Trainer`: tokens/s, memory, MFU.

    .venv/bin/python -m benchmarks.lm_throughput [--preset cpu] [--steps 20] [--warmup 3]
        [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--compile] [--data synthetic|real]
        [--threads N] [--set model.dim=256 ...]
    .venv/bin/python -m benchmarks.lm_throughput --compare-threads [--repeats 3] \
        --preset tiny --preset cpu

``--compare-threads`` (CPU) runs each preset three times in this process, one after the other:
the default path (the trainer's ``num_threads: auto``), ``num_threads: 1`` and ``num_threads``
= all of this process's cores, each after at least 3 untimed warm-up steps, and prints each
one's steady step time, its whole run and its ratio to the faster fixed count of the same repeat (``--repeats``: medians
of that many runs of each, taken in rotating order).

The model, optimizer (AdamW as the recipe builds it, fused by default) and trainer settings
(dtype, gradient clipping, publish interval) come from a preset of `recipes.lm.config`,
merged as the recipe's command line does (`gangtrain.app.cli.load_config`); validation and
checkpoints are off. Batches are random bytes made up front on the device (``--data
real`` reads the preset's byte windows instead). The first ``--warmup`` steps (compilation,
allocator, lazy recorder set-up) are not timed; the clock runs from the first timed step to
the end of the run, after a device synchronisation at both ends.

Prints tokens/s and peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: peak RSS
and its growth during training), and on CUDA the model FLOP utilisation: tokens/s x
``gangtrain.models.gpt.model.flops_per_token`` / the GPU's dense peak for the dtype (the trainer's table by
GPU name; unknown GPUs print no MFU).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

from gangtrain.app.cli import load_config
from gangtrain.models.gpt.model import GPT, GPTConfig, flops_per_token, num_parameters
from recipes.lm.config import PRESETS, LMConfig
from trainer.errors import UserError
from trainer.lifecycle.threads import available_cores
from trainer.observe.system_metrics import peak_flops as device_peak_flops
from units.causal_lm import CausalLMUnit

Batch = dict[str, torch.Tensor]

def peak_flops(device: torch.device, dtype: str) -> tuple[str, float | None]:
    """(the device's name, its dense peak FLOP/s for `dtype`, or None for a CPU or a GPU
    the trainer's table (`trainer.observe.system_metrics.peak_flops`) does not know)."""
    if device.type != "cuda":
        return "cpu", None
    return torch.cuda.get_device_name(device), device_peak_flops(device, dtype)


def gpt_config_from(config: LMConfig) -> GPTConfig:
    """The model of an `LMConfig`, as the recipe builds it."""
    m, d = config.model, config.data
    return GPTConfig(seq_len=d.seq_len, dim=m.dim, num_layers=m.num_layers,
                     num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, dropout=m.dropout,
                     num_experts=m.num_experts, top_k=m.top_k, tie_embeddings=m.tie_embeddings)


def synthetic_pool(vocab_size: int, batch_size: int, seq_len: int, device: torch.device,
                   num_batches: int = 4) -> list[Batch]:
    """`num_batches` LM batches of random tokens, made on `device` (seeded: the same on
    every call)."""
    generator = torch.Generator(device=device).manual_seed(0)
    pool = []
    for _ in range(num_batches):
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator,
                               device=device)
        pool.append({"input_ids": tokens[:, :-1].contiguous(),
                     "target_ids": tokens[:, 1:].contiguous()})
    return pool


class SyntheticReader:
    """`num_batches` batches of random bytes, cycling a pool made up front on the device;
    synchronises the device and stamps the time when batch `timed_from` is drawn."""

    def __init__(self, pool: list[Batch], num_batches: int, timed_from: int,
                 device: torch.device) -> None:
        self.pool = pool
        self.num_batches = num_batches
        self.timed_from = timed_from
        self.device = device
        self.started: float | None = None
        self.first: float | None = None  # when the first batch was drawn

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.num_batches):
            if i == 0:
                self.first = time.perf_counter()
            if i == self.timed_from:
                _synchronize(self.device)
                self.started = time.perf_counter()
            yield self.pool[i % len(self.pool)]


class DeviceReader(SyntheticReader):
    """The same clock around real batches (host tensors), moved to the device as drawn."""

    def __init__(self, batches: Iterator[Batch], num_batches: int, timed_from: int,
                 device: torch.device) -> None:
        super().__init__([], num_batches, timed_from, device)
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.num_batches):
            batch = next(self.batches)
            if i == 0:
                self.first = time.perf_counter()
            if i == self.timed_from:
                _synchronize(self.device)
                self.started = time.perf_counter()
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _real_batches(config: LMConfig) -> Iterator[Batch]:
    from recipes.lm.data import ByteWindowReader, find_source_files, load_bytes, split_files

    d = config.data
    train_files, _ = split_files(find_source_files(d.root), d.valid_fraction, d.split_seed)
    reader = ByteWindowReader(load_bytes(train_files, d.max_train_bytes), d.seq_len,
                              d.batch_size, seed=d.shuffle_seed)
    while True:  # epochs, endlessly
        yield from reader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", dest="presets", action="append", choices=sorted(PRESETS),
                        help="the recipe's preset (default cpu; repeat for several)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override, as the recipe's --set")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if there)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="default: the preset's trainer.dtype")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--data", choices=("synthetic", "real"), default="synthetic")
    parser.add_argument("--threads", type=int, default=0,
                        help="the trainer's num_threads (0: its default, auto)")
    parser.add_argument("--compare-threads", action="store_true",
                        help="default vs 1 thread vs all cores, each preset (CPU)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--compare-threads: runs of each path (medians)")
    args = parser.parse_args(argv)
    args.presets = args.presets or ["cpu"]
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if args.compare_threads and device.type != "cpu":
        print("error: --compare-threads is for the CPU", file=sys.stderr)
        return 2
    for preset in args.presets:
        try:
            config = load_config(LMConfig, PRESETS, preset, overrides=args.overrides)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if not args.compare_threads:
            if run_once(args, preset, config, device, args.threads or "auto") is None:
                return 1
            continue
        args.warmup = max(args.warmup, 3)  # the ratios are of the steady step
        paths = [("default", "auto"), ("1 thread", 1), ("all cores", available_cores())]
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in paths}
        for repeat in range(args.repeats):  # each repeat in another order: drift spreads out
            for label, setting in paths[repeat % 3:] + paths[:repeat % 3]:
                timing = run_once(args, preset, config, device, setting)
                if timing is None:
                    return 1
                runs[label].append(timing)
        # Ratios within a repeat (runs next to each other), then their median: a loaded
        # machine drifts more between repeats than within one.
        fastest = [min(one[0], every[0]) for one, every in zip(runs["1 thread"],
                                                               runs["all cores"])]
        for label, timings in runs.items():
            ratio = statistics.median(t[0] / f for t, f in zip(timings, fastest))
            step_ms = statistics.median(t[0] for t in timings) * 1e3
            whole = statistics.median(t[1] for t in timings)
            print(f"threads {preset} {label}: {step_ms:.1f} ms/step, whole run {whole:.1f} s, "
                  f"ratio to the faster fixed count {ratio:.2f} (medians of {len(timings)} "
                  f"runs)", flush=True)
    return 0


def run_once(args: argparse.Namespace, preset: str, config: LMConfig, device: torch.device,
             num_threads: int | str) -> tuple[float, float] | None:
    """Train `preset` once and print its figures; (seconds a timed step, seconds of the
    whole run), or None after printing an error."""
    dtype = args.dtype or config.trainer.dtype

    from gangs import FakeGang, setup_gangs

    gangs = setup_gangs(FakeGang(device=device))
    d, o = config.data, config.optimizer
    gpt_config = gpt_config_from(config)
    torch.manual_seed(config.trainer.seed)
    model = GPT(gpt_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                  weight_decay=o.weight_decay, fused=o.fused)

    num_batches = args.warmup + args.steps
    if args.data == "synthetic":
        pool = synthetic_pool(gpt_config.vocab_size, d.batch_size, d.seq_len, device)
        reader: SyntheticReader = SyntheticReader(pool, num_batches, args.warmup, device)
    else:
        reader = DeviceReader(_real_batches(config), num_batches, args.warmup, device)

    trainer_config = config.trainer.model_copy(update={
        "max_num_steps": num_batches, "max_num_data_epochs": None,
        "validate_every_n_steps": None, "validate_at_start": False, "validate_at_end": False,
        "checkpoint_every_n_steps": None, "keep_last_n_checkpoints": None,
        "keep_best_n_checkpoints": None, "score_metric": None, "early_stopper": None,
        "dtype": dtype, "compile_model": args.compile or config.trainer.compile_model,
        "progress": False, "wandb_project": None, "num_threads": num_threads,
    })
    tokens_per_step = d.batch_size * d.seq_len * trainer_config.num_accumulate
    print(f"lm {preset}: {num_parameters(model) / 1e6:.2f}M parameters, "
          f"{tokens_per_step} tokens a step ({d.batch_size} x {d.seq_len}"
          f"{f' x {trainer_config.num_accumulate}' if trainer_config.num_accumulate > 1 else ''}"
          f"), {dtype}, {'compiled' if trainer_config.compile_model else 'eager'}, "
          f"AdamW(fused={o.fused}), {args.data} data, device {device}"
          f"{'' if device.type == 'cuda' else f', num_threads {num_threads}'}",
          flush=True)

    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = _rss_mib()
    with tempfile.TemporaryDirectory(prefix="gangtrain-lm-throughput-") as output_dir:
        trainer = trainer_config.build(CausalLMUnit(model, bytes_per_token=1), reader,
                                       optimizer, output_dir=output_dir, gangs=gangs,
                                       resume=False, recorders=[])
        result = trainer.run()
        _synchronize(device)
        ended = time.perf_counter()
    if result.num_steps != num_batches or reader.started is None or reader.first is None:
        print(f"error: the trainer ran {result.num_steps} of {num_batches} steps "
              f"({result.stop_reason})", file=sys.stderr)
        return None

    elapsed = ended - reader.started
    tokens_per_s = args.steps * tokens_per_step / elapsed
    achieved = tokens_per_s * flops_per_token(gpt_config)
    loss = result.last_metrics.get("loss", float("nan"))
    threads = "" if device.type == "cuda" else f", {torch.get_num_threads()} threads"
    print(f"throughput {preset} ({args.steps} steps after {args.warmup} warm-up{threads}): "
          f"{tokens_per_s:,.0f} tokens/s, {elapsed / args.steps * 1e3:.1f} ms/step, "
          f"model {achieved / 1e12:.3g} TFLOP/s, last loss {loss:.3f}", flush=True)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"memory {preset}: peak allocated {peak:.2f} GiB "
              f"(torch.cuda.max_memory_allocated)", flush=True)
        name, peak_rate = peak_flops(device, dtype)
        if peak_rate is None:
            print(f"mfu {preset}: unknown peak for '{name}' ({dtype})", flush=True)
        else:
            print(f"mfu {preset}: {achieved / peak_rate:.1%} of {name} {dtype} dense peak "
                  f"{peak_rate / 1e12:.0f} TFLOP/s", flush=True)
    else:
        peak = _peak_rss_mib()
        print(f"memory {preset}: peak RSS {peak:.0f} MiB, growth during training "
              f"{max(0.0, peak - rss_before):.0f} MiB", flush=True)
    return elapsed / args.steps, ended - reader.first


if __name__ == "__main__":
    sys.exit(main())
