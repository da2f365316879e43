"""gangtrain's SFT step against TRL's `SFTTrainer`, paired and interleaved (`python -m
benchmarks.sft --against-trl`; needs `pip install trl`, a benchmark dependency only).

Both sides get the same things: a Llama built from the same config and seed (4 layers x 256,
an 8,192-token vocabulary by default; `--vocab 151936` for a Qwen-sized one), the same
pre-tokenised conversations (a chat length mix: log-normal, median ~196 tokens, a tail to
2,700, cut at the row length; the first ~40% of each a prompt, not trained), rows of
`--seq-len` tokens, `--rows` rows a step, AdamW, fp32, one thread.

- packed: gangtrain packs best-fit decreasing into rows with `position_ids` (per-document
  attention, `models.hf.document_attention`; the head at trained positions only); TRL packs
  with its "bfd" strategy (padding-free, `position_ids`).
- padded: each step's examples padded to the longest (HF style, `attention_mask`).

Every run is a process of its own (`--worker`), so peak RSS is its own; a round runs the four
(framework x layout) in turn and the ratios are taken within a round, so a shared machine's
slow spells hit both sides of a ratio alike. Per run: trained tokens/s over the steps after
the first (the first is warm-up), time from the process start to the end of the first step
(imports, model, data preparation included), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
RUNS = (("ours", "packed"), ("trl", "packed"), ("ours", "padded"), ("trl", "padded"))


def conversations(num: int, vocab: int, seq_len: int, seed: int = 0
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids, trained mask) of `num` synthetic conversations (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(196), 0.85, num).astype(int), 16, min(2700, seq_len))
    ids, masks = [], []
    for n in lengths:
        prompt = int(n * rng.uniform(0.25, 0.55))
        ids.append(rng.integers(3, vocab, n).tolist())
        masks.append([0] * prompt + [1] * (n - prompt))
    return ids, masks


def llama(vocab: int, seq_len: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
        tie_word_embeddings=False, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="sdpa"))


def ours(args: argparse.Namespace, ids: list[list[int]], masks: list[list[int]]) -> dict:
    import numpy as np
    import torch

    from gangtrain.data.collate import packed_batch
    from gangtrain.data.example_packing import best_fit_decreasing
    from gangtrain.models.hf.document_attention import use_document_attention
    from units.causal_lm import CausalLMUnit
    from units.metrics import MetricBag

    model = llama(args.vocab, args.seq_len)
    use_document_attention(model)
    unit = CausalLMUnit(model, loss_chunk_size=args.loss_chunk_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    examples = list(zip(ids, masks, strict=True))
    order = np.random.default_rng(1).permutation(len(examples))
    if args.layout == "packed":
        plan = best_fit_decreasing(np.array([len(i) for i in ids]), args.seq_len)
        rows = [[examples[i] for i in plan.row(r)] for r in range(plan.num_rows)]
        rows = [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]
        batches = (packed_batch(rows[s:s + args.rows], args.seq_len, pad_id=0)
                   for s in range(0, len(rows), args.rows))
    else:
        batches = (padded_batch([examples[i] for i in order[s:s + args.rows]])
                   for s in range(0, len(order), args.rows))
    return timed_steps(args, batches, lambda batch: train_step(unit, optimizer, batch,
                                                               MetricBag))


def padded_batch(examples: list[tuple[list[int], list[int]]]) -> dict:
    import torch

    longest = max(len(i) for i, _ in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (tokens, trained) in enumerate(examples):
        t = torch.tensor(tokens)
        ids[row, :len(tokens)], mask[row, :len(tokens)] = t, 1
        labels[row, :len(tokens)] = t.masked_fill(torch.tensor(trained) == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_step(unit, optimizer, batch, metric_bag) -> int:
    loss, num_targets = unit(batch, metric_bag())
    (loss / num_targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    return int(num_targets)


def timed_steps(args: argparse.Namespace, batches, step) -> dict:
    first_step, wall, cpu, trained = None, 0.0, 0.0, 0
    for n, batch in zip(range(args.steps + 1), batches, strict=False):
        start, start_cpu = time.perf_counter(), time.process_time()
        targets = step(batch)
        if n == 0:
            first_step = first_step_times()
        else:
            wall += time.perf_counter() - start
            cpu += time.process_time() - start_cpu
            trained += targets
    return rates(trained, wall, cpu, first_step)


def first_step_times() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) from its start to now."""
    return time.perf_counter() - START, time.process_time()


def rates(trained: int, wall: float, cpu: float, first_step: tuple[float, float]) -> dict:
    """Trained tokens per CPU second (what a step costs: one thread, so a loaded machine's
    waits for a core do not count) and per wall second; the first step's end."""
    return {"trained_per_cpu_s": trained / cpu, "trained_per_s": trained / wall,
            "first_step_s": first_step[0], "first_step_cpu_s": first_step[1]}


def trl(args: argparse.Namespace, ids: list[list[int]], masks: list[list[int]]) -> dict:
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = PreTrainedTokenizerFast(  # ids are given: only the pad token is read
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2},
                                                    unk_token="<pad>")),
        pad_token="<pad>", eos_token="</s>")
    dataset = Dataset.from_dict({"input_ids": ids, "assistant_masks": masks})
    timings = {"wall": 0.0, "cpu": 0.0, "trained": 0, "first": None, "step": 0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timings["start"], timings["start_cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            if timings["step"] == 0:
                timings["first"] = first_step_times()
            else:
                timings["wall"] += time.perf_counter() - timings["start"]
                timings["cpu"] += time.process_time() - timings["start_cpu"]
            timings["step"] += 1

    class CountingTrainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if timings["step"] > 0:  # HF shifts labels: the first of each row scores nothing
                timings["trained"] += int((inputs["labels"][:, 1:] != -100).sum())
            return super().training_step(model, inputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out, max_steps=args.steps + 1, per_device_train_batch_size=args.rows,
            packing=args.layout == "packed", packing_strategy="bfd", max_length=args.seq_len,
            learning_rate=1e-5, optim="adamw_torch", lr_scheduler_type="constant",
            logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
            dataloader_num_workers=0, bf16=False, fp16=False, seed=1,
            disable_tqdm=True)
        trainer = CountingTrainer(model=llama(args.vocab, args.seq_len), args=config,
                                  train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[StepTimer()])
        torch.set_num_threads(1)
        trainer.train()
    return rates(timings["trained"], timings["wall"], timings["cpu"], timings["first"])


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    ids, masks = conversations(args.conversations, args.vocab, args.seq_len)
    result = (ours if args.framework == "ours" else trl)(args, ids, masks)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def run_once(args: argparse.Namespace, framework: str, layout: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.sft_trl", "--worker", framework, layout,
               "--vocab", str(args.vocab), "--rows", str(args.rows), "--steps",
               str(args.steps), "--seq-len", str(args.seq_len), "--conversations",
               str(args.conversations)]
    if args.loss_chunk_size:
        command += ["--loss-chunk-size", str(args.loss_chunk_size)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{framework} {layout} failed:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(args: argparse.Namespace) -> None:
    print(f"against TRL: Llama 4 x 256, vocabulary {args.vocab:,}, rows of {args.seq_len}, "
          f"{args.rows} rows a step, {args.steps} timed steps after one warm-up, AdamW, fp32, "
          f"one thread, {args.rounds} interleaved rounds"
          + (f", loss_chunk_size {args.loss_chunk_size}" if args.loss_chunk_size else ""))
    ratios: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        results = {run: run_once(args, *run) for run in RUNS}
        for (framework, layout), r in results.items():
            print(f"round {round_ + 1} {framework:4s} {layout}: {r['trained_per_cpu_s']:,.0f} "
                  f"trained tokens per CPU s ({r['trained_per_s']:,.0f} per wall s), first "
                  f"step at {r['first_step_cpu_s']:.1f} CPU s ({r['first_step_s']:.1f} wall "
                  f"s), peak RSS {r['peak_rss_mib']:,.0f} MiB", flush=True)
        pairs = {
            "packed, ours / TRL, trained tokens per CPU s": (
                ("ours", "packed"), ("trl", "packed"), "trained_per_cpu_s"),
            "padded, ours / TRL, trained tokens per CPU s": (
                ("ours", "padded"), ("trl", "padded"), "trained_per_cpu_s"),
            "ours, packed / padded, trained tokens per CPU s": (
                ("ours", "packed"), ("ours", "padded"), "trained_per_cpu_s"),
            "packed, ours / TRL, trained tokens per wall s": (
                ("ours", "packed"), ("trl", "packed"), "trained_per_s"),
            "padded, ours / TRL, trained tokens per wall s": (
                ("ours", "padded"), ("trl", "padded"), "trained_per_s"),
            "packed, ours / TRL, peak RSS": (("ours", "packed"), ("trl", "packed"),
                                             "peak_rss_mib"),
            "padded, ours / TRL, peak RSS": (("ours", "padded"), ("trl", "padded"),
                                             "peak_rss_mib"),
            "packed, ours / TRL, CPU time to the first step's end": (
                ("ours", "packed"), ("trl", "packed"), "first_step_cpu_s"),
        }
        for name, (a, b, key) in pairs.items():
            ratios.setdefault(name, []).append(results[a][key] / results[b][key])
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.2f}x (rounds "
              f"{', '.join(f'{v:.2f}' for v in values)})")


def memory_sweep(args: argparse.Namespace) -> None:
    """Peak RSS of our packed step, the head on trained positions with and without the
    chunked loss, across vocabularies and rows a step: what grows with vocabulary x tokens."""
    print(f"memory: our packed step (rows of {args.seq_len}, {args.steps} timed steps), "
          "peak RSS in MiB; the parameters, gradients and AdamW state take 16 bytes a "
          "parameter")
    for vocab in (8192, 151936):
        params = llama(vocab, args.seq_len).num_parameters()
        for rows in (1, 4):
            peaks = {}
            for chunk in (None, 1024):
                setting = argparse.Namespace(**{**vars(args), "vocab": vocab, "rows": rows,
                                                "loss_chunk_size": chunk})
                peaks[chunk] = run_once(setting, "ours", "packed")["peak_rss_mib"]
            print(f"vocabulary {vocab:,} ({params / 1e6:.1f}M parameters, "
                  f"{16 * params / 2**20:,.0f} MiB of state), {rows} rows: whole logits "
                  f"{peaks[None]:,.0f}, chunks of 1,024 {peaks[1024]:,.0f} "
                  f"({peaks[None] - peaks[1024]:+,.0f})", flush=True)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sft --against-trl")
    parser.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "LAYOUT"))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--loss-chunk-size", type=int, default=None)
    parser.add_argument("--memory-sweep", action="store_true",
                        help="peak RSS of our step with and without the chunked loss")
    args = parser.parse_args(argv)
    if args.worker:
        args.framework, args.layout = args.worker
    return args


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.worker:
        worker(args)
    elif args.memory_sweep:
        memory_sweep(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
