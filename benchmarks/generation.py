"""Tokens/s of `gangtrain.rl.generation.HFGenerator` against transformers' `model.generate`
and its continuous batching (`model.generate_batch`, a paged KV cache; it runs on the CPU in
transformers 5.25, left out with the reason printed where it fails) on the same random
Llama, prompts and lengths, one process, one thread, batch 8 and 32, every row running to the
limit (no stop token; `generate` with ``min_new_tokens``), temperature 1, no top-k, at issue
#69's two shapes and Qwen2.5-0.5B's (`benchmarks.real_size.QWEN_05B`: hidden 896, 24 layers,
14/2 heads, MLP 4864, a tied 151,936-row embedding); and the roofline of the run.

The roofline is the least time the run's unavoidable work takes on this machine, measured in
the same rounds: the linear layers alone (every ``nn.Linear`` of the model applied by
``F.linear`` to its own weight: the prompts' real tokens once, then one batch row per new
token) plus the attention's reads of K and V at the read bandwidth of a buffer the KV cache's
size; norms, rotary, sampling, padding and cache writes count as free. Last round's figure
(the decode step's FLOPs only, every matmul at the slower of two shapes' ``a @ b`` rate) is
printed beside it: it left the prefill out (unreachable) and charged the small matmuls at the
head's rate (generous).

Rates are per CPU second of this process (the 2-core machine is shared: one thread's CPU time
is its wall time on an idle core); each generator runs ``--repeats`` times, interleaved, and
the medians are shown, with the share of each one's best run in the best roofline round (at
a load that moves between seconds, each figure's least disturbed measurement).
``--against REV`` adds REV's generator (its `gangtrain.rl` modules from git), interleaved in
the same process.

    PYTHONPATH=src:. python -m benchmarks.generation [--shapes 40m 42m 0.5b] [--batches 8 32]
        [--new N] [--repeats 3] [--ours-only] [--against main]

``--new`` overrides each shape's new tokens (16 at 0.5B, to keep its run short).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks.real_size import QWEN_05B
from gangtrain.rl.generation import HFGenerator

SHAPES = {  # vocab, hidden, layers, intermediate, heads, key/value heads, new tokens
    "40m": (32_000, 512, 8, 1376, 8, 8, 64),
    "42m": (151_936, 256, 4, 1024, 4, 4, 32),
    "0.5b": (QWEN_05B["vocab"], QWEN_05B["hidden"], QWEN_05B["layers"],
             QWEN_05B["intermediate"], QWEN_05B["heads"], QWEN_05B["kv_heads"], 16),
}


def build(shape: str) -> LlamaForCausalLM:
    vocab, hidden, layers, inter, heads, kv_heads, _ = SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, tie_word_embeddings=True,
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


def hf_generate_batch(model: LlamaForCausalLM, prompts: list[list[int]], new: int,
                      sample: bool) -> int:
    """transformers' continuous batching: `generate_batch` over a paged cache sized to the run
    (its default sizes the cache from a GPU's free memory: on the CPU ~10x slower here), all
    prompts prefilled in one batch, every row to ``new`` tokens (no end-of-sequence id)."""
    page = 64
    blocks = len(prompts) * math.ceil((max(map(len, prompts)) + new + 1) / page) + 1
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                  max_batch_tokens=max(512, sum(map(len, prompts))))
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample \
        else dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=new, eos_token_id=-1, pad_token_id=0, **kw)
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=cb, progress_bar=False,
                                   warmup=False)
    lengths = [len(o.generated_tokens) for o in out.values()]
    if len(lengths) != len(prompts) or set(lengths) != {new}:
        raise RuntimeError(f"generate_batch returned {len(lengths)} rows of lengths "
                           f"{sorted(set(lengths))}, not {len(prompts)} of {new}")
    return sum(lengths)


def timed(fn: Callable[[], int]) -> float:
    """Tokens per CPU second of this process."""
    start = time.process_time()
    tokens = fn()
    return tokens / (time.process_time() - start)


def matmul_rate(m: int, k: int, n: int, reps: int = 5) -> float:
    """FLOP/s of one [m, k] @ [k, n] product repeated (its operands stay in cache)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    start = time.process_time()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.process_time() - start)


def linear_seconds(model: LlamaForCausalLM, rows: int, head_rows: int, reps: int = 3) -> float:
    """CPU seconds of a forward's linear layers alone: every ``nn.Linear`` of the model applied
    to ``rows`` rows (the head to ``head_rows``), each its own weight (so the weights stream
    through the caches as in the real forward), in the faster of two layouts: ``F.linear``
    as the model calls it, and ``x @ w`` over a transposed copy (this machine's GEMM is ~10%
    faster so at batch 32). The median of ``reps``, each layout's best."""
    calls = [(m.weight, head_rows if m is model.lm_head else rows)
             for m in model.modules() if isinstance(m, nn.Linear)]
    xs = {(r, w.shape[1]): torch.randn(r, w.shape[1]) for w, r in calls}
    transposed = [w.detach().t().contiguous() for w, _ in calls]

    def as_model() -> None:
        for w, r in calls:
            F.linear(xs[(r, w.shape[1])], w)

    def pre_transposed() -> None:
        for (w, r), wt in zip(calls, transposed, strict=True):
            xs[(r, w.shape[1])] @ wt

    times = []
    for _ in range(reps + 1):  # the first: warm-up
        best = math.inf
        for replay in (as_model, pre_transposed):
            start = time.process_time()
            replay()
            best = min(best, time.process_time() - start)
        times.append(best)
    return median(times[1:])


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of reading a float32 buffer of ``nbytes`` (a sum over it), repeated: the
    cache level such a buffer lives in, as the KV cache of that size does."""
    buf = torch.randn(max(nbytes // 4, 1024))
    buf.sum()
    start = time.process_time()
    for _ in range(reps):
        buf.sum()
    return buf.numel() * 4 * reps / (time.process_time() - start)


def roofline_seconds(model: LlamaForCausalLM, prompts: list[list[int]], new: int) -> float:
    """The least CPU time the run's work can take here: the prefill's linear layers over the
    prompts' real tokens (the head at each row's last one), then ``new`` decode steps of the
    whole batch, each its linear layers' time plus its attention's reads of K and V (the
    rows' contexts, at the read bandwidth of a buffer the KV cache's size). Everything else
    (norms, rotary, sampling, the cache writes, padding) counts as free."""
    cfg = model.config
    batch, real = len(prompts), sum(map(len, prompts))
    kv_width = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # K and V bytes per context token and layer; the contexts the decode steps attend to
    per_token = 2 * cfg.num_hidden_layers * kv_width * 4
    contexts = sum(len(p) + t for p in prompts for t in range(1, new + 1))
    bandwidth = read_bandwidth(per_token * (real + batch * new))
    return (linear_seconds(model, real, batch) + new * linear_seconds(model, batch, batch)
            + per_token * contexts / bandwidth)


ENGINE_MODULES = ("sampling", "slot_cache", "engine", "generation")
"""`gangtrain.rl`'s generator modules, in import order."""


def generator_at(rev: str) -> type:
    """``rev``'s `HFGenerator`: its generator modules read from git, loaded as a package of
    their own (``rev_rl``) so that both trees' engines run interleaved in one process."""
    package = types.ModuleType("rev_rl")
    package.__path__ = []
    sys.modules["rev_rl"] = package
    for name in ENGINE_MODULES:
        source = subprocess.run(["git", "show", f"{rev}:src/gangtrain/rl/{name}.py"],
                                capture_output=True, text=True, check=True).stdout
        module = types.ModuleType(f"rev_rl.{name}")
        sys.modules[module.__name__] = module
        source = source.replace("from gangtrain.rl.", "from rev_rl.")
        exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
    return sys.modules["rev_rl.generation"].HFGenerator


def measure(shape: str, model: LlamaForCausalLM, batch: int, new: int | None, repeats: int,
            ours_only: bool, against: str | None) -> None:
    vocab, hidden, layers, inter, heads, kv_heads, default_new = SHAPES[shape]
    new = new or default_new
    prompts = make_prompts(batch, vocab)
    seeds = list(range(batch))

    def ours(temperature: float, kind: type = HFGenerator) -> Callable[[], int]:
        generator = kind(model, stop_ids=[10 ** 9], pad_id=0, max_new_tokens=new,
                         temperature=temperature)
        return lambda: sum(len(c.ids) for c in generator.generate(prompts, seeds))

    runs = {"ours sampled": ours(1.0),
            "HF generate sampled": lambda: hf_generate(model, prompts, new, True),
            "ours greedy": ours(0.0),
            "HF generate greedy": lambda: hf_generate(model, prompts, new, False),
            "HF generate_batch sampled": lambda: hf_generate_batch(model, prompts, new, True),
            "HF generate_batch greedy": lambda: hf_generate_batch(model, prompts, new, False)}
    if against is not None:
        theirs = generator_at(against)
        runs[f"{against}'s sampled"] = ours(1.0, theirs)
        runs[f"{against}'s greedy"] = ours(0.0, theirs)
    if ours_only:
        runs = {name: run for name, run in runs.items() if not name.startswith("HF")}
    runs["ours sampled"]()  # warm-up: the allocator, first-call costs
    for name in [n for n in runs if "generate_batch" in n]:
        try:
            runs[name]()  # warm-up, and whether it runs here at all
        except Exception as error:  # noqa: BLE001 -- any failure: say why, measure the rest
            print(f"{name}: left out, it fails on this machine: {type(error).__name__}: "
                  f"{str(error)[:200]}")
            del runs[name]
    # each generator `repeats` times, interleaved (the machine's load moves between them),
    # and both rooflines measured in every round; the median of each
    seen: dict[str, list[float]] = {name: [] for name in runs}
    roof: list[float] = []
    matmul: list[float] = []
    for _ in range(repeats):
        for name, run in runs.items():
            seen[name].append(timed(run))
        roof.append(batch * new / roofline_seconds(model, prompts, new))
        matmul.append(min(matmul_rate(batch, hidden, vocab), matmul_rate(batch, hidden, inter)))
    rates = {name: median(r) for name, r in seen.items()}
    roofline = median(roof)
    # last round's figure: decode FLOPs only, all at the slower of two shapes' a @ b rates
    kv_width = kv_heads * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q and o; k and v (GQA)
    per_token = 2 * (layers * (attention + 3 * hidden * inter) + hidden * vocab)
    flops_roofline = median(matmul) / per_token
    hf = rates.get("HF generate sampled", math.nan)
    print(f"\n## {shape}: vocab {vocab}, hidden {hidden}, {layers} layers, {heads}/{kv_heads} "
          f"heads, batch {batch}, "
          f"{new} new tokens, prompts 16-48 tokens ({sum(map(len, prompts))} in all)")
    print(f"roofline {roofline:.0f} tokens/s (the run's linear layers alone + its K/V reads, "
          f"rounds: {', '.join(f'{r:.0f}' for r in roof)}); decode-FLOPs-only figure "
          f"{flops_roofline:.0f} ({median(matmul) / 1e9:.1f} GFLOP/s, "
          f"{per_token / 1e6:.1f} MFLOP/token)")
    # the best run of each over the best roofline round too: at a load that moves between
    # seconds, each figure's least disturbed run
    print("| generator | tokens/s | / HF generate sampled | share of roofline | "
          "best run / best roofline | share of decode-FLOPs figure |")
    print("|---|---|---|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {r:.0f} | {r / hf:.2f}x | {r / roofline:.0%} | "
              f"{max(seen[name]) / max(roof):.0%} | {r / flops_roofline:.0%} |")


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", "--shape", nargs="+", choices=[*SHAPES, "both"],
                        default=["40m", "42m"], help="both: 40m and 42m (issue #69's two)")
    parser.add_argument("--batches", "--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--new", type=int, default=None,
                        help="new tokens a row (default: the shape's, 64/32/16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ours-only", action="store_true",
                        help="leave transformers' generate out")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="also REV's generator (a git revision, e.g. main), interleaved")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [s for name in args.shapes for s in (("40m", "42m") if name == "both" else (name,))]
    for shape in dict.fromkeys(shapes):
        model = build(shape)
        for batch in args.batches:
            measure(shape, model, batch, args.new, args.repeats, args.ours_only, args.against)


if __name__ == "__main__":
    main()
