"""SFT (full and LoRA) and DPO at the size users train, against TRL, in one run.

    .venv/bin/python -m benchmarks.real_size [--steps 4] [--warmup 1] [--rounds 1]
        [--pairs 2] [--seq-len 512] [--only sft,lora,dpo] [--no-trl] [--work DIR]
        [--dtype fp32|bf16]
        [--hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936]

The model is a random-init Llama of Qwen2.5-0.5B's shape by default (hidden 896, 24 layers,
14 query and 2 key/value heads, MLP 4864, a tied 151,936-row embedding: 494M parameters),
saved as safetensors with a tiny ChatML tokenizer; nothing is downloaded. Smaller shapes by
the flags, to try the benchmark itself. fp32 on a CPU (one thread), bf16 autocast on a GPU
(`--dtype` to choose). On a GPU the defaults are 20 steps of which 5 warm up (kernel choice,
the caching allocator), memory is the GPU's (the caching allocator's peak reservation, what
an out-of-memory error is measured against), and time is wall time.

Each measured run is a fresh process, ours and TRL's alternated (sft, then lora, then dpo,
ours first each time), and the ratios are taken between the runs of one round:

- full SFT and LoRA (r=16, alpha 32, the seven projections): rows of `--seq-len` tokens, one
  row a step, every record one row of text (all its tokens trained); trained tokens/s over
  the steps after the `--warmup` ones; peak RSS at the end of the last step (VmHWM);
- DPO, `--pairs` pairs a step, a frozen copy as the reference, beta 0.1: pairs/s, peak RSS;
- the losses of step 1 on both sides (full SFT: the same tokens through the same weights);
- MFU of the full-SFT step: 6 x parameters x tokens / step time, over the machine's own
  matmul rate measured in a process of its own (the model's matmul shapes, one thread, the
  run's dtype);
- the checkpoint our SFT run saved at its last step: bytes (12 a parameter is the fp32 model
  and AdamW's two moments), save time; a resume of it (one step more): its load time (the
  checksums verified and the state read) and
  its time from process start to the first step, against the SFT run's; beside them, in
  this process, a plain write + fsync and a read of as many random (non-repeating) bytes
  (into one reused buffer, and into fresh memory of their size: a resume must also bring
  the optimizer's state into memory the process does not have yet). Every read is from the
  disk: the checkpoint's and the plain file's pages are dropped from the page cache first.

The table ends the run: each figure per round, beside issue #56's target for it (`TARGETS`)
and whether every round met it.

AdamW fused, lr 1e-5 constant, betas (0.9, 0.999), no weight decay, clipping at 1.0, seed 0,
on both sides. The machine is shared: say what else ran when quoting figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
            "vocab": 151936}
KINDS = ("sft", "lora", "dpo")
COUNTED = {"sft": "trained tokens", "lora": "trained tokens", "dpo": "pairs"}
"""What each kind's speed counts a second."""
MEMORY = {"cpu": "peak RSS", "cuda": "peak GPU memory"}
"""The memory figure on each device."""


def speed_figure(kind: str) -> str:
    return f"{kind}: {COUNTED[kind]}/s, ours / TRL"


def memory_figure(kind: str, memory: str) -> str:
    return f"{kind}: {memory}, ours / TRL"


def loss_figure(kind: str) -> str:
    return f"{kind}: step-1 loss, ours - TRL"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_size")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps a run (default: 4 on a CPU, 20 on a GPU)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps at the start (default: 1 on a CPU, 5 on a GPU)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=2, help="DPO pairs a step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--only", default=",".join(KINDS))
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="default: bf16 (autocast) on a GPU, fp32 on a CPU")
    for name, value in QWEN_05B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args(argv)
    args.shape = {name: getattr(args, name) for name in QWEN_05B}
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    gpu = args.device == "cuda"
    args.steps = args.steps if args.steps is not None else (20 if gpu else 4)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    args.memory = MEMORY[args.device]
    return args


def run(role: str, args: argparse.Namespace, work: Path) -> dict:
    """One fresh process (`real_size_workers.worker`); its RESULT."""
    command = [sys.executable, "-m", "benchmarks.real_size", "--worker", role, "--work",
               str(work), "--steps", str(args.steps), "--pairs", str(args.pairs),
               "--seq-len", str(args.seq_len), "--dtype", args.dtype,
               "--warmup", str(args.warmup)]
    for name, value in args.shape.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "NO_COLOR": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{role} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def plain_disk(path: Path, size: int, chunk: int = 64 << 20) -> tuple[float, float, float]:
    """(seconds to write `size` random bytes and fsync, seconds to read them back into one
    reused buffer, seconds to read them into fresh memory of their size, as a resume must
    place them), only the write, fsync and reads timed (the bytes are made between writes:
    non-repeating, so that nothing below us dedups or compresses them)."""
    rng = np.random.default_rng(0)
    written, write_s = 0, 0.0
    with open(path, "wb") as f:
        while written < size:
            block = rng.integers(0, 256, min(chunk, size - written), dtype=np.uint8).tobytes()
            start = time.perf_counter()
            f.write(block)
            write_s += time.perf_counter() - start
            written += len(block)
        start = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
        write_s += time.perf_counter() - start
    buffer = bytearray(chunk)
    evict_from_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    read_s = time.perf_counter() - start
    evict_from_cache(path)
    start = time.perf_counter()
    fresh = np.empty(size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        for offset in range(0, size, chunk):
            f.readinto(memoryview(fresh)[offset:offset + chunk])
    fresh_read_s = time.perf_counter() - start
    evict_from_cache(path)
    del fresh
    path.unlink()
    return write_s, read_s, fresh_read_s


def evict_from_cache(path: Path) -> None:
    """Drop `path`'s pages from the page cache, so that the next read comes from the disk
    (both the resume's and the plain reads: a written file is otherwise read from memory)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def step_times(result: dict, args: argparse.Namespace) -> list[float]:
    """The timed steps' seconds (after the `--warmup` ones): CPU seconds on a CPU (one thread:
    a loaded machine's waits for a core do not count), wall seconds on a GPU."""
    return result["step_s" if args.device == "cpu" else "step_wall_s"][args.warmup:]


def tokens_per_s(result: dict, tokens_a_step: int, args: argparse.Namespace) -> float:
    timed = step_times(result, args)
    return tokens_a_step * len(timed) / sum(timed)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.worker:
        from benchmarks.real_size_workers import worker

        worker(args.worker, args.work, args)
        return
    kinds = [k for k in args.only.split(",") if k]
    frameworks = ["ours"] if args.no_trl else ["ours", "trl"]
    if not args.no_trl:
        try:
            import trl
        except ImportError:
            print("trl is not installed (pip install trl): ours only")
            frameworks = ["ours"]
        else:
            print(f"trl {trl.__version__}")
    work = args.work or Path(tempfile.mkdtemp(prefix="real_size_"))
    work.mkdir(parents=True, exist_ok=True)
    made = run("make", args, work)
    n = made["parameters"]
    print(f"model: Llama {args.shape}, {n:,} parameters, {args.dtype} on {args.device}; rows "
          f"of {args.seq_len}, {args.steps} steps a run ({args.warmup} untimed); work dir {work}",
          flush=True)
    rate = run("matmul", args, work)["flops_per_s"]
    print(f"matmul rate (the model's shapes, one thread, {args.dtype}): {rate / 1e9:.1f} "
          f"GFLOP/{'CPU ' if args.device == 'cpu' else ''}s", flush=True)
    targets = args.seq_len - 1  # one row a step, every token but the last a target
    table: dict[str, list[float]] = {}
    for round_nr in range(args.rounds):
        results: dict[tuple[str, str], dict] = {}
        for kind in kinds:
            for framework in frameworks:
                r = results[framework, kind] = run(f"{framework}:{kind}", args, work)
                print(f"round {round_nr + 1} {framework:4s} {kind:4s}: steps "
                      f"{', '.join(f'{s:.2f}' for s in r['step_s'])} CPU s ("
                      f"{', '.join(f'{s:.2f}' for s in r['step_wall_s'])} wall s); losses "
                      f"{', '.join(f'{x:.7f}' for x in r['losses'][:3])}; {args.memory} "
                      f"{r['train_peak_gib']:.2f} GiB at the last step, "
                      f"{r['peak_gib']:.2f} GiB in all ({r.get('start_peak_gib', float('nan')):.2f} "
                      f"before the first step, then {', '.join(f'{g:.2f}' for g in r['step_peaks_gib'])}); first step ends at "
                      f"{r['first_step_end_s']:.1f} s", flush=True)
            if kind == "sft":
                r = results["ours", "sft"]
                mfu = 6 * n * args.seq_len / statistics.median(step_times(r, args)) / rate
                table.setdefault("full SFT, our MFU (6N, of the matmul rate)", []).append(mfu)
                if ("trl", "sft") in results:
                    t = results["trl", "sft"]
                    table.setdefault("full SFT, TRL's MFU", []).append(
                        6 * n * args.seq_len / statistics.median(step_times(t, args)) / rate)
                if "checkpoint_bytes" in r:
                    checkpoint(args, work, r, n, table)
        for kind in kinds:
            if ("trl", kind) not in results:
                continue
            ours, theirs = results["ours", kind], results["trl", kind]
            per_step = args.pairs if kind == "dpo" else targets
            table.setdefault(speed_figure(kind), []).append(
                tokens_per_s(ours, per_step, args) / tokens_per_s(theirs, per_step, args))
            table.setdefault(memory_figure(kind, args.memory), []).append(
                ours["train_peak_gib"] / theirs["train_peak_gib"])
            table.setdefault(loss_figure(kind), []).append(
                ours["losses"][0] - theirs["losses"][0])
        print_table(table)


def checkpoint(args: argparse.Namespace, work: Path, r: dict, n: int,
               table: dict[str, list[float]]) -> None:
    """The checkpoint figures: bytes, save and resume against the plain disk's rate."""
    size = r["checkpoint_bytes"]
    for f in Path(r["checkpoint_dir"]).rglob("*"):
        if f.is_file():
            evict_from_cache(f)  # a resume reads what it has not just written
    resumed = run("ours:resume", args, work)
    write_s, read_s, fresh_read_s = plain_disk(work / "plain.bin", size)
    print(f"checkpoint: {size:,} bytes ({size / n:.2f} a parameter); save {r['save_s']:.2f} "
          f"s, plain write + fsync of as many bytes {write_s:.2f} s; resume's load "
          f"{resumed.get('load_s', float('nan')):.2f} s, plain read {read_s:.2f} s (into "
          f"fresh memory {fresh_read_s:.2f} s); first "
          f"step ends {resumed['first_step_end_s']:.1f} s after process start resumed, "
          f"{r['first_step_end_s']:.1f} s fresh; resumed losses "
          f"{', '.join(f'{x:.7f}' for x in resumed['losses'])}", flush=True)
    table.setdefault("checkpoint bytes / (12 x parameters)", []).append(size / (12 * n))
    table.setdefault("save / plain write + fsync", []).append(r["save_s"] / write_s)
    table.setdefault("resume's load / plain read", []).append(resumed["load_s"] / read_s)
    table.setdefault("resume's load / plain read into fresh memory", []).append(
        resumed["load_s"] / fresh_read_s)
    table.setdefault("resume: training starts later than fresh, wall s", []).append(
        resumed["train_start_s"] - r["train_start_s"])
    table.setdefault("resume: training starts later than fresh, CPU s", []).append(
        resumed["train_start_cpu_s"] - r["train_start_cpu_s"])
    shutil.rmtree(Path(r["checkpoint_dir"]).parent.parent / "hf", ignore_errors=True)


TARGETS = {  # issue #56's, by the figure's name: (low, high), either end open
    **{speed_figure(kind): (1.3, None) for kind in KINDS},
    **{memory_figure(kind, memory): (None, 1.0 if kind == "dpo" else 0.9)
       for kind in KINDS for memory in MEMORY.values()},
    **{loss_figure(kind): (-1e-6, 1e-6) for kind in KINDS},
    "full SFT, our MFU (6N, of the matmul rate)": (0.75, None),
    "checkpoint bytes / (12 x parameters)": (0.98, 1.02),
    "save / plain write + fsync": (None, 1.2),
    "resume's load / plain read": (None, 1.2),
}


def verdict(bounds: tuple[float | None, float | None], values: list[float]) -> str:
    """The target `bounds` as text, and whether every round's value is within them."""
    low, high = bounds
    if low is not None and high is not None:
        wanted = f"{low:.3g} to {high:.3g}"
    else:
        wanted = f">= {low:.3g}" if low is not None else f"<= {high:.3g}"
    met = all((low is None or v >= low) and (high is None or v <= high) for v in values)
    return f"{wanted}: {'met' if met else 'not met'}"


def print_table(table: dict[str, list[float]]) -> None:
    print("\n| figure | value (per round) | the issue's target |\n|---|---|---|")
    for name, values in table.items():
        wanted = verdict(TARGETS[name], values) if name in TARGETS else ""
        print(f"| {name} | {', '.join(f'{v:.3g}' for v in values)} | {wanted} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
