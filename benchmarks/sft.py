"""Supervised fine-tuning data path: packing, throughput, tokenising, memory on a large file.

    .venv/bin/python -m benchmarks.sft [--steps 12] [--rss-gb 1.0] [--skip-rss]
        [--conversations 20000]
    .venv/bin/python -m benchmarks.sft --against-trl [--vocab 8192] [--rows 2] [--steps 2]
        [--rounds 3] [--loss-chunk-size N]     (needs `pip install trl`; see benchmarks.sft_trl)

Prints, in one run:

1. packing efficiency (non-pad tokens / tokens) of best-fit decreasing into rows of 2048 on
   a realistic length mix (log-normal, median ~200 tokens, a long tail to 4096, as chat sets
   such as ShareGPT have), beside padding each batch of 8 to its longest;
2. trained tokens/s of a small Llama (4 layers, width 128) fed packed rows against padded
   batches of the same examples (the same model, optimizer and loop; the ratio is the point);
3. tokenising throughput (tokens/s) of conversations with the chat template and masks,
   cold (empty cache) and cached (a second run's `tokenize_files`);
4. peak memory of `python -m recipes.sft` training a few steps on a JSONL of ``--rss-gb``
   GB made in /tmp (tokenised on the way, into a cache), against the file's size: peak RSS,
   its file-backed part (the memory-mapped Arrow tables: page cache the kernel reclaims) and
   the peak anonymous memory (what the process itself holds), sampled from /proc every
   0.2 s; then the same command again on the cached data: its wall time, start to end;

Against TRL's SFTTrainer (`--against-trl`): `benchmarks.sft_trl`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gangtrain.data.example_packing import best_fit_decreasing
from gangtrain.data.sft import tokenize_files
from gangtrain.data.token_batches import BinReader, plan_bins
from gangtrain.tiny.chat import chat_conversations, make_tiny_chat_model
from units.causal_lm import CausalLMUnit
from units.metrics import MetricBag

ROOT = Path(__file__).resolve().parents[1]


def length_mix(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 0.9, n).astype(int), 16, 4096)


def packing_efficiency() -> None:
    lengths = length_mix(20000)
    start = time.perf_counter()
    plan = best_fit_decreasing(lengths, 2048)
    took = time.perf_counter() - start
    order = np.random.default_rng(1).permutation(len(lengths))
    clipped = np.minimum(lengths, 2048)
    padded = sum(clipped[order[i : i + 8]].max() * len(order[i : i + 8])
                 for i in range(0, len(order), 8))
    print(f"packing: 20,000 examples (median {int(np.median(lengths))}, mean "
          f"{lengths.mean():.0f}, max {lengths.max()} tokens) into rows of 2048: "
          f"{plan.num_rows:,} rows, efficiency {plan.efficiency():.4f} "
          f"({plan.num_truncated} truncated; best-fit decreasing took {took:.2f} s); padding "
          f"batches of 8 to the longest: efficiency {clipped.sum() / padded:.3f}")


def tiny_llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        attn_implementation="sdpa"))


def trained_tokens_per_s(steps: int) -> None:
    from datasets import Dataset

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(120), 0.7, 4000).astype(int), 16, 512)
    ids = [rng.integers(1, 500, n).tolist() for n in lengths]
    # Half of each example trained (a prompt, then an answer), as chat data has.
    trained = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    dataset = Dataset.from_dict({"input_ids": ids, "trained": trained})
    # The two layouts' steps alternate, so a shared machine's slow spells hit both alike.
    runs = {}
    for layout, batch_size in (("padded", 8), ("packed", 4)):
        bins = plan_bins(lengths, layout, 512)
        model = tiny_llama(512)
        runs[layout] = {"reader": iter(BinReader(dataset, bins, batch_size, pad_id=0, seed=0)),
                        "unit": CausalLMUnit(model), "batch_size": batch_size,
                        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
                        "targets": 0, "tokens": 0, "elapsed": 0.0}
    for step in range(steps + 2):
        for run in runs.values():
            batch = next(run["reader"])
            start = time.perf_counter()
            loss, n = run["unit"](batch, MetricBag())
            (loss / n).backward()
            run["optimizer"].step()
            run["optimizer"].zero_grad()
            if step >= 2:  # the first two warm up
                run["elapsed"] += time.perf_counter() - start
                run["targets"] += int(n)
                run["tokens"] += batch["input_ids"].numel()
    rate = {}
    for layout, run in runs.items():
        rate[layout] = run["targets"] / run["elapsed"]
        print(f"{layout}: {rate[layout]:,.0f} trained tokens/s ({run['targets']:,} trained of "
              f"{run['tokens']:,} tokens in {steps} steps of {run['batch_size']} rows, "
              f"{run['elapsed']:.1f} s)")
    print(f"packed / padded trained tokens/s: {rate['packed'] / rate['padded']:.2f}x "
          "(target >= 1.5x; the same examples, model and optimizer, steps alternating)")


def tokenising_throughput(model_dir: Path, work: Path, num: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = work / "chat.jsonl"
    with path.open("w") as f:
        for messages in chat_conversations(num, seed=5):
            f.write(json.dumps({"messages": messages}) + "\n")
    cache = work / "tok_cache"
    for num_proc, label in ((1, "cold, 1 process"), (2, "cold, 2 processes")):
        shutil.rmtree(cache, ignore_errors=True)
        start = time.perf_counter()
        t = tokenize_files([path], tokenizer, name="tiny", cache_dir=cache, num_proc=num_proc)
        took = time.perf_counter() - start
        print(f"tokenising {num:,} conversations ({int(t.lengths.sum()):,} tokens, chat "
              f"template and masks), {label}: {t.lengths.sum() / took:,.0f} tokens/s "
              f"({took:.1f} s, reading the JSONL included)")
    start = time.perf_counter()
    t = tokenize_files([path], tokenizer, name="tiny", cache_dir=cache)
    took = time.perf_counter() - start
    print(f"the same, cached: {took:.2f} s ({t.lengths.sum() / took:,.0f} tokens/s)")


def write_big_jsonl(path: Path, gigabytes: float) -> int:
    """Text records of ~600 bytes of arithmetic sentences, up to `gigabytes`; the size. A
    block of 20,000 records is written again and again (the memory and the tokenising do
    not depend on records being distinct, and it writes in seconds)."""
    rng = random.Random(0)
    words = ("plus", "minus", "times")
    lines = []
    for _ in range(20000):
        sentences = [f"What is {rng.randint(0, 99)} {rng.choice(words)} {rng.randint(0, 99)}?"
                     for _ in range(18)]
        lines.append(json.dumps({"text": " ".join(sentences)}) + "\n")
    block = "".join(lines)
    target, size = int(gigabytes * 1e9), 0
    with path.open("w") as f:
        while size < target:
            f.write(block)
            size += len(block)
    return size


def peak_rss(model_dir: Path, work: Path, gigabytes: float) -> None:
    big = work / "big.jsonl"
    start = time.perf_counter()
    size = write_big_jsonl(big, gigabytes)
    print(f"wrote {big} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    valid = work / "valid.jsonl"
    valid.write_text("".join(json.dumps({"text": f"What is {i} plus {i}?"}) + "\n"
                             for i in range(64)))
    cache = work / "rss_cache"
    command = [sys.executable, "-m", "recipes.sft", "OUT", "--preset", "tiny",
               "--set", f"model.path={model_dir}", "--set", f"data.files=[{big}]",
               "--set", f"data.valid_files=[{valid}]", "--set", f"data.cache_dir={cache}",
               "--set", "trainer.max_num_steps=5", "--set", "trainer.validate_every_n_steps=5",
               "--set", "trainer.checkpoint_every_n_steps=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    for n, label in enumerate(("first run (tokenising into the cache)",
                               "second run (cached)")):
        out = work / f"out_{n}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        proc = subprocess.Popen([str(out) if a == "OUT" else a for a in command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        peak = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
        while proc.poll() is None:
            for key, kib in _status(proc.pid).items():
                peak[key] = max(peak[key], kib)
            time.sleep(0.2)
        stdout, stderr = proc.communicate()
        took = time.perf_counter() - start
        if proc.returncode != 0:
            print(stdout[-2000:], stderr[-4000:])
            raise SystemExit(f"the recipe failed: exit {proc.returncode}")
        summary = next((line for line in stdout.splitlines()
                        if line.startswith("data train")), "")
        gib = 2**20
        print(f"{label}: {took:.0f} s wall; peak RSS {peak['VmHWM'] / gib:.2f} GiB, of which "
              f"at most {peak['RssFile'] / gib:.2f} GiB file-backed (memory-mapped Arrow "
              f"pages, which the kernel drops under pressure); peak anonymous memory "
              f"{peak['RssAnon'] / gib:.2f} GiB = {peak['RssAnon'] * 1024 / size:.2f} x the "
              f"file; {summary}")
    print(f"JSONL {size / 2**30:.2f} GiB")


def _status(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS), RssAnon, RssFile of a process, KiB (Linux /proc)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            values[key] = int(rest.split()[0])
    return values


def main() -> None:
    if "--against-trl" in sys.argv[1:]:  # its own options: benchmarks.sft_trl
        from benchmarks.sft_trl import main as against_trl

        against_trl([a for a in sys.argv[1:] if a != "--against-trl"])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sft")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rss-gb", type=float, default=1.0)
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--only-rss", action="store_true")
    parser.add_argument("--work", type=Path, default=None,
                        help="a directory for the files (default: a temporary one)")
    parser.add_argument("--conversations", type=int, default=20000,
                        help="conversations tokenised for the throughput figures")
    args = parser.parse_args()
    # One thread: on this kind of VM two OpenMP threads make small ops many times slower.
    torch.set_num_threads(1)
    from datasets import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
    if not args.only_rss:
        packing_efficiency()
        trained_tokens_per_s(args.steps)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = make_tiny_chat_model(work / "model")
        if not args.only_rss:
            tokenising_throughput(model_dir, work, args.conversations)
        if not args.skip_rss:
            peak_rss(model_dir, work, args.rss_gb)
    print("TRL: `python -m benchmarks.sft --against-trl` compares with its SFTTrainer "
          "(benchmarks.sft_trl; needs `pip install trl`)")


if __name__ == "__main__":
    main()
