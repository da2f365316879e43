"""Tokens/s of `gangtrain.rl.generation.HFGenerator` against transformers' `model.generate`
on the same random Llama, prompts and lengths, one process, one thread, batch 32, every row
running to the limit (no stop token; `generate` with ``min_new_tokens``), temperature 1, no
top-k, at issue #69's two shapes; and the roofline: the decode step's matmul FLOPs at the
one-thread matmul rate measured in the same run at the step's shapes. Rates are per CPU
second of this process (the 2-core machine is shared: one thread's CPU time is its wall time
on an idle core); each generator runs ``--repeats`` times, interleaved with one measurement
of the matmul rate, and the medians are shown. ``--today`` adds main's generator (its source
from git) for comparison.

    PYTHONPATH=src:. python -m benchmarks.generation [--shape 40m|42m] [--today] [--repeats 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gangtrain.rl.generation import HFGenerator

SHAPES = {  # vocab, hidden, layers, intermediate, heads, new tokens
    "40m": (32_000, 512, 8, 1376, 8, 64),
    "42m": (151_936, 256, 4, 1024, 4, 32),
}


def build(shape: str) -> LlamaForCausalLM:
    vocab, hidden, layers, inter, heads, _ = SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=heads, tie_word_embeddings=True,
                         max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (int(torch.randint(16, 49, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(batch)]


def hf_generate(model: LlamaForCausalLM, prompts: list[list[int]], new: int, sample: bool
                ) -> int:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate wants it
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample \
        else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, **kw)
    return (out.shape[1] - width) * len(prompts)


def timed(fn: Callable[[], int]) -> float:
    """Tokens per CPU second of this process."""
    start = time.process_time()
    tokens = fn()
    return tokens / (time.process_time() - start)


def matmul_rate(m: int, k: int, n: int, reps: int = 5) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    start = time.process_time()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.process_time() - start)


def todays_generator() -> type:
    """main's HFGenerator, its source read from git (a one-file module)."""
    source = subprocess.run(["git", "show", "main:src/gangtrain/rl/generation.py"],
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("todays_generation")
    sys.modules[module.__name__] = module
    exec(compile(source, "main:generation.py", "exec"), module.__dict__)
    return module.HFGenerator


def measure(shape: str, batch: int, today: bool, repeats: int) -> None:
    vocab, hidden, layers, inter, _, new = SHAPES[shape]
    model = build(shape)
    prompts = make_prompts(batch, vocab)
    seeds = list(range(batch))

    def ours(kind: type, temperature: float) -> Callable[[], int]:
        generator = kind(model, stop_ids=[10 ** 9], pad_id=0, max_new_tokens=new,
                         temperature=temperature)
        return lambda: sum(len(c.ids) for c in generator.generate(prompts, seeds))

    runs = {"ours sampled": ours(HFGenerator, 1.0),
            "HF generate sampled": lambda: hf_generate(model, prompts, new, True),
            "ours greedy": ours(HFGenerator, 0.0),
            "HF generate greedy": lambda: hf_generate(model, prompts, new, False)}
    if today:
        old = todays_generator()
        runs["today's HFGenerator sampled"] = ours(old, 1.0)
        runs["today's HFGenerator greedy"] = ours(old, 0.0)
    runs["ours sampled"]()  # warm-up: the allocator, first-call costs
    # each generator `repeats` times, interleaved (the machine's load moves between them);
    # the median of each
    seen: dict[str, list[float]] = {name: [] for name in runs}
    matmul: list[float] = []  # the step's matmul rate, measured in every round too
    for _ in range(repeats):
        for name, run in runs.items():
            seen[name].append(timed(run))
        matmul.append(min(matmul_rate(batch, hidden, vocab), matmul_rate(batch, hidden, inter)))
    rates = {name: sorted(r)[len(r) // 2] for name, r in seen.items()}
    per_token = 2 * (layers * (4 * hidden * hidden + 3 * hidden * inter) + hidden * vocab)
    rate = sorted(matmul)[len(matmul) // 2]
    roofline = rate / per_token
    hf = rates["HF generate sampled"]
    print(f"\n## {shape}: vocab {vocab}, hidden {hidden}, {layers} layers, batch {batch}, "
          f"{new} new tokens, prompts 16-48 tokens")
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s -> roofline {roofline:.0f} tokens/s "
          f"({per_token / 1e6:.1f} MFLOP/token)")
    print("| generator | tokens/s | / HF generate sampled | share of roofline |")
    print("|---|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {r:.0f} | {r / hf:.2f}x | {r / roofline:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--today", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for shape in list(SHAPES) if args.shape == "both" else [args.shape]:
        measure(shape, args.batch, args.today, args.repeats)


if __name__ == "__main__":
    main()
