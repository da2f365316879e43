"""The engine behind `HFGenerator` (`gangtrain.rl.engine`, `gangtrain.rl.sampling`): the
counter-based sampler draws from the softmax (frequencies within the sampling error of the
draw count), its hash is splitmix64's; greedy decoding equals transformers' `generate`; the
log-probabilities equal a full forward with stops, cuts, refills and chunked prefill; a
completion depends on its seed only, whatever the slots, syncs and chunks; a continued row
(tokens appended after a turn, multi-turn's tool results) equals a fresh generation of its
whole context."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gangtrain.rl.engine import Engine, Request, prefill_groups
from gangtrain.rl.generation import HFGenerator
from gangtrain.rl.sampling import mix64, sample_tokens

STOPS = list(range(100, 130))


def tiny_llama(vocab: int = 320) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def random_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (int(torch.randint(3, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def full_forward_logps(model, prompt, ids, temperature) -> torch.Tensor:
    x = torch.tensor([list(prompt) + list(ids)])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float() / temperature
    p = len(prompt)
    return logits.log_softmax(-1)[p - 1:-1].gather(-1, x[0, p:, None])[:, 0]


def splitmix64_finaliser(x: int) -> int:  # the reference algorithm, in Python integers
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_the_hash_is_splitmix64():
    xs = [0, 1, 12345, (1 << 63) - 1, 2 ** 40 + 7, -5]
    got = mix64(torch.tensor(xs, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [splitmix64_finaliser(x & ((1 << 64) - 1))
                                                   for x in xs]


@pytest.mark.parametrize(("vocab", "top_p"), [(12, 1.0), (12, 0.8), (2500, 1.0)])
def test_sampling_frequencies_match_the_softmax(vocab, top_p):
    """60,000 draws (20,000 of 2,500 tokens; distinct seeds) of one logit row. Each token's count is binomial:
    |freq - p| <= z * sqrt(p (1 - p) / n) with z = 5.3 fails by chance with probability
    1.2e-7 per token, under 3e-4 over 2,500 tokens (Bonferroni). 2,500 = three blocks of the
    two-level inverse CDF, the last partial; most mass sits on tokens in different blocks
    (top-p sorts the whole row, no blocks: 12 tokens show it)."""
    torch.manual_seed(0)
    logits = torch.randn(1, vocab) * 2
    if vocab > 12:
        logits[0, [5, 1030, 2100, 2499]] += 9
    n, temperature = (60_000 if vocab <= 12 else 20_000), 0.7
    tok, lp = sample_tokens(logits.expand(n, -1), torch.arange(n) * 7919 + 3,
                            torch.full((n,), 5), temperature, top_p)
    p = (logits[0].double() / temperature).softmax(-1)
    if top_p < 1:  # the top-p set: drop a token when the mass before it reaches top_p
        ordered, order = p.sort(descending=True)
        keep = (ordered.cumsum(0) - ordered) < top_p
        p = torch.zeros_like(p).index_put_((order[keep],), ordered[keep])
        p = p / p.sum()
    freq = torch.bincount(tok, minlength=vocab).double() / n
    bound = 5.3 * (p * (1 - p) / n).sqrt() + 1 / n  # + one draw: p's of exactly 0 stay 0
    assert bool(((freq - p).abs() <= bound).all()), float(((freq - p).abs() - bound).max())
    assert (freq[p == 0] == 0).all()
    # the log-probabilities: log_softmax(logits / T) before top-p, float32 (1e-6 ~ 8 ulps)
    assert torch.allclose(lp, (logits[0] / temperature).log_softmax(-1)[tok], atol=1e-6)


def test_greedy_equals_transformers_generate():
    model = tiny_llama()
    rows = random_prompts(4)
    ours = HFGenerator(model, stop_ids=[], pad_id=0, max_new_tokens=8, temperature=0
                       ).generate(rows, [0] * 4)
    for r, c in zip(rows, ours, strict=True):
        ref = model.generate(torch.tensor([r]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(r):].tolist()
        assert list(c.ids) == ref


def test_logprobs_equal_a_full_forward_with_stops_refills_and_chunks():
    """4 slots for 12 rows (refills), syncs every 3 tokens, prefill chunks of 5: the
    log-probabilities are the full forward's within 1e-5 (float32 logits of size ~10 over a
    different kernel order: ~100 ulps), stops end a completion, cuts are marked truncated."""
    model = tiny_llama()
    rows = random_prompts(12)
    gen = HFGenerator(model, stop_ids=STOPS, pad_id=0, max_new_tokens=10, temperature=0.9,
                      max_batch=4, sync_every=3, prefill_chunk=5)
    out = gen.generate(rows, list(range(12)))
    worst = 0.0
    for p, c in zip(rows, out, strict=True):
        ref = full_forward_logps(model, p, c.ids, 0.9)
        worst = max(worst, float((torch.tensor(c.logprobs) - ref).abs().max()))
        if c.truncated:
            assert len(c.ids) == 10 and not set(c.ids) & set(STOPS)
        else:
            assert c.ids[-1] in STOPS and not set(c.ids[:-1]) & set(STOPS)
    assert worst < 1e-5, worst
    assert len({len(c.ids) for c in out}) > 1 and any(c.truncated for c in out)


def test_a_completion_depends_on_its_seed_not_on_slots_syncs_or_chunks():
    model = tiny_llama()
    rows, seeds = random_prompts(10), [1000 + i for i in range(10)]
    kw = dict(stop_ids=STOPS[:15], pad_id=0, max_new_tokens=12, temperature=1.0)
    together = HFGenerator(model, **kw, max_batch=10).generate(rows, seeds)
    small = HFGenerator(model, **kw, max_batch=3, sync_every=2, prefill_chunk=4
                        ).generate(rows, seeds)
    reverse = HFGenerator(model, **kw, max_batch=4).generate(rows[::-1], seeds[::-1])[::-1]
    assert [c.ids for c in together] == [c.ids for c in small] == [c.ids for c in reverse]
    for a, b in zip(together, small, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    assert len({c.ids for c in together}) == 10


def test_on_the_cpu_sampling_ends_when_the_last_row_stops():
    """By default on the CPU the engine reads the slots after every decode step (a host
    read costs nothing there): a batch costs one prefill and one decode forward a token of
    its longest completion, as `generate` does; every 8 steps it runs on to the next read."""
    model = tiny_llama()
    rows, seeds = [p[:3] for p in random_prompts(8)], list(range(8))  # one prefill forward
    kw = dict(stop_ids=STOPS, pad_id=0, max_new_tokens=100, temperature=1.0)
    each = HFGenerator(model, **kw)
    out = each.generate(rows, seeds)
    longest = max(len(c.ids) for c in out)
    assert not any(c.truncated for c in out) and longest % 8 != 1  # a read in 8 overshoots
    assert each.engine.forwards == 1 + (longest - 1)
    eight = HFGenerator(model, **kw, sync_every=8)
    assert [c.ids for c in eight.generate(rows, seeds)] == [c.ids for c in out]
    assert eight.engine.forwards == 1 + math.ceil((longest - 1) / 8) * 8


def test_a_continued_row_equals_a_fresh_generation_of_its_whole_context():
    """Turn 1, then tokens appended (a tool's result, of unequal lengths), then turn 2 in the
    same slot = a fresh generation from prompt + turn 1 + the tokens, with the same seed:
    identical ids, log-probabilities within 1e-5 of it and of a full forward."""
    model = tiny_llama()
    rows = random_prompts(6)
    appended = {i: list(range(200, 203 + i)) for i in range(6)}

    def on_stop(i, turn, request):
        return (appended[i], 6) if len(request.turns) == 1 else None

    engine = Engine(model, stop_ids=STOPS + list(range(130, 140)), pad_id=0, max_batch=3,
                    sync_every=2, prefill_chunk=4)
    done = engine.run([Request(r, 77 + i, 6) for i, r in enumerate(rows)], capacity=64,
                      on_stop=on_stop)
    for i, (r, request) in enumerate(zip(rows, done, strict=True)):
        assert len(request.turns) == 2
        context = r + request.turns[0].ids + appended[i]
        fresh = Engine(model, stop_ids=engine.stop_ids, pad_id=0).run(
            [Request(context, 77 + i, 6)], capacity=64)[0].turns[0]
        assert fresh.ids == request.turns[1].ids
        second = torch.tensor(request.turns[1].logprobs)
        assert (torch.tensor(fresh.logprobs) - second).abs().max() < 1e-5
        assert (full_forward_logps(model, context, fresh.ids, 1.0) - second).abs().max() < 1e-5


def test_long_prompts_are_prefilled_in_chunks():
    model = tiny_llama()
    rows = [list(range(5, 95)), list(range(7, 40))]
    kw = dict(stop_ids=[], pad_id=0, max_new_tokens=5)
    chunked, whole = HFGenerator(model, **kw, prefill_chunk=16), HFGenerator(model, **kw)
    assert [c.ids for c in chunked.generate(rows, [1, 2])] == \
        [c.ids for c in whole.generate(rows, [1, 2])]
    # the same decode steps; prefill: 6 chunks of 16 (both rows in them) against 2 forwards
    # (rows of 90 and 33 tokens are prefilled apart when whole: `prefill_groups`)
    assert chunked.engine.forwards - whole.engine.forwards == math.ceil(90 / 16) - 2


@pytest.mark.parametrize("seed", range(3))
def test_prefill_groups_cost_the_fewest_tokens(seed):
    """Against every split of the length-sorted rows into consecutive runs (2^7 for 8 rows):
    the groups cover each row once and cost the least padded tokens + 16 a forward."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (8,), generator=g).tolist()
    chunk = 20

    def cost(group: list[int]) -> int:
        longest = max(lengths[k] for k in group)
        width = min(chunk, longest)
        return math.ceil(longest / width) * (len(group) * width + 16)

    groups = prefill_groups(lengths, chunk, forward_cost=16)
    assert sorted(k for grp in groups for k in grp) == list(range(8))
    order = sorted(range(8), key=lambda k: lengths[k])
    best = min(sum(cost(order[a:b]) for a, b in zip([0, *cuts], [*cuts, 8], strict=True))
               for r in range(8) for cuts in map(list, itertools.combinations(range(1, 8), r)))
    assert sum(map(cost, groups)) == best
