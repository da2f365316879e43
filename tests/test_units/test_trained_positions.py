"""The stock causal-LM unit runs the LM head at the trained positions only (and, with
`loss_chunk_size`, chunk by chunk): its loss and gradients are the full head's, computed
here by hand from the model's own full logits, for a HF Llama and the LM recipe's GPT,
packed rows and padded batches, one process and TP2."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks
from tolerances import FLOAT32_UNIT, reordered_sum_rtol
from torch.distributed.tensor import DTensor
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from gangs.fake import FakeGang
from gangtrain.data.collate import packed_batch
from gangtrain.models.gpt.model import GPT, GPTConfig
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit, auto_loss_chunk_size
from units.linear_cross_entropy import linear_cross_entropy, linear_log_probs
from units.metrics import MetricBag

VOCAB, PAD, SEQ = 96, 0, 24

# reason: the kept-position head and the full head sum the <= 6 x 13 trained positions' losses
# (and gradients), each a log-sum-exp over VOCAB logits of d=32 terms, in float32, in another
# order where BLAS blocks [n, d] x [d, V] unlike [b*t, d] x [d, V]: relative (the gradients'
# to each parameter's largest entry)
REL = reordered_sum_rtol(6 * 13 + VOCAB + 32)
# reason: as REL, and TP2 splits each of the 2 layers' row-parallel sums (<= 64 terms) in two
TP_REL = reordered_sum_rtol(6 * 13 + VOCAB + 2 * 64 + 32)
# The chunked-head tests below: 37 rows, 16 hidden, 50 classes.
ROWS, HIDDEN, CLASSES = 37, 16, 50


def examples(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Six examples of 3 to 13 tokens, the first half of each a prompt (not trained)."""
    g = torch.Generator().manual_seed(seed)
    result = []
    for length in (7, 13, 3, 9, 11, 5):
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        result.append((ids, [0] * (length // 2) + [1] * (length - length // 2)))
    return result


def packed() -> dict[str, torch.Tensor]:
    """Rows of 24: [7, 13, pad 4], [3, 9, 11, pad 1], [5, pad 19]."""
    exs = examples()
    return packed_batch([exs[:2], exs[2:5], exs[5:]], seq_len=SEQ, pad_id=PAD)


def padded() -> dict[str, torch.Tensor]:
    """HF style: one example a row, padded on the right (attention mask 0), labels -100 on
    the prompt."""
    exs = examples()
    ids = torch.full((len(exs), 13), PAD)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (tokens, trained) in enumerate(exs):
        n = len(tokens)
        ids[row, :n] = torch.tensor(tokens)
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(tokens).masked_fill(torch.tensor(trained) == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def llama(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, initializer_range=0.2, use_cache=False))


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, num_layers=2, num_heads=4))


def full_head_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference: the model's full logits, shifted and masked here by hand."""
    keywords = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
    if not isinstance(model, GPT):  # with a KV cache, transformers ignores packed positions
        keywords["use_cache"] = False
    out = model(batch["input_ids"], **keywords)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    labels = batch["labels"][:, 1:]
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")


def loss_and_grads(model, compute) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = compute()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, expected, rel: float = REL) -> float:
    """The loss relative, each gradient relative to its largest entry; returns the largest gap
    as a fraction of `rel` (<= 1 passes)."""
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert loss == pytest.approx(ref_loss, rel=rel, abs=0)
    gap = abs(loss / ref_loss - 1) / rel
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = rel * ref.abs().max().item()
        diff = (grad - ref).abs().max().item()
        assert diff <= scale, name
        gap = max(gap, diff / scale if scale else 0.0)
    print(f"gap (of float32's allowance): {gap:.2f}")
    return gap


@pytest.mark.parametrize("make_model", [llama, gpt], ids=["hf_llama", "gpt"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["kept_head", "chunked_loss"])
def test_trained_position_head_gives_the_full_heads_loss_and_gradients(make_model, layout,
                                                                       chunk):
    model = make_model()
    batch = packed() if layout == "packed" else padded()
    if make_model is gpt:  # the GPT takes no attention_mask: padding is in the labels only
        batch.pop("attention_mask", None)
    unit = CausalLMUnit(model, loss_chunk_size=chunk)
    calls = []  # the head's input rows: the trained positions only
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: calls.append(args[0].shape[0]))
    got = loss_and_grads(model, lambda: unit(batch, MetricBag())[0])
    handle.remove()
    trained = int((batch["labels"][:, 1:] != -100).sum())
    assert calls == [0 if chunk else trained]  # chunked: the head's own matmul is skipped
    assert_same(got, loss_and_grads(model, lambda: full_head_loss(model, batch)))


def test_eval_unit_on_trained_positions_records_the_full_heads_loss_and_accuracy():
    model, batch = llama(), packed()
    records = {}
    for trained_only in (True, False):
        metrics = MetricBag()
        CausalLMEvalUnit(model, token_accuracy=True, trained_positions_only=trained_only)(
            batch, metrics)
        records[trained_only] = metrics
    with torch.no_grad():
        expected = full_head_loss(model, batch).item()
    values = records[True].sync_and_compute(FakeGang())
    assert values == pytest.approx(records[False].sync_and_compute(FakeGang()), rel=REL,
                                   abs=0)
    assert values["loss"] * int((batch["labels"][:, 1:] != -100).sum()) == pytest.approx(
        expected, rel=REL, abs=0)


def test_chunked_cross_entropy_equals_the_full_one_with_bias_and_ignored_targets():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[::5] = -100
    got = loss_and_grads_of(lambda: linear_cross_entropy(hidden, weight, bias, targets, 8),
                            (hidden, weight, bias))
    ref = loss_and_grads_of(lambda: F.cross_entropy(hidden @ weight.t() + bias, targets,
                                                    reduction="sum"), (hidden, weight, bias))
    # reason: the 37 rows' losses, each a log-sum-exp over 50 logits of 16 terms, summed in
    # float32 by chunk and whole: relative (gradients to their largest entry)
    rel = reordered_sum_rtol(ROWS + CLASSES + HIDDEN)
    assert got[0] == pytest.approx(ref[0], rel=rel, abs=0)
    gap = abs(got[0] / ref[0] - 1) / rel
    for a, b in zip(got[1], ref[1], strict=True):
        assert (a - b).abs().max().item() <= rel * b.abs().max().item()
        gap = max(gap, (a - b).abs().max().item() / (rel * b.abs().max().item()))
    print(f"gap (of float32's allowance): {gap:.2f}")


def test_chunked_log_probs_equal_the_full_log_softmax_and_its_gradients():
    """Each row's log-probability of its target, and the gradients of a weighted sum of them
    (a preference loss weighs each answer differently), against float64 whole logits."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)

    def full():
        logits = hidden.double() @ weight.double().t() + bias.double()
        return logits.log_softmax(-1)[torch.arange(37), targets]

    # reason: one float32 computation against float64: a logit's 16 products and the
    # log-sum-exp's 50 terms within (16 + 50) u of exact, relative to the logits' scale; the
    # gradients' sums over 37 rows and 50 classes as well, relative to their largest entry
    rtol = (HIDDEN + CLASSES) * FLOAT32_UNIT
    grad_rtol = (ROWS + CLASSES + HIDDEN) * FLOAT32_UNIT
    with torch.no_grad():
        scale = (hidden.double() @ weight.double().t() + bias.double()).abs().max().item()
    for chunk in (8, 37, 64):  # uneven chunks, one chunk, one larger than the rows
        got = linear_log_probs(hidden, weight, bias, targets, chunk)
        ref = full()
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=rtol * scale)
        gap = (got.double() - ref).abs().max().item() / (rtol * scale)
        got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
        ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), (hidden, weight, bias))
        for a, b in zip(got_grads, ref_grads, strict=True):
            assert (a.double() - b).abs().max().item() <= grad_rtol * b.abs().max().item()
            gap = max(gap, (a.double() - b).abs().max().item()
                      / (grad_rtol * b.abs().max().item()))
        print(f"gap (of float32's allowance): {gap:.2f}")


def test_chunked_head_under_autocast_is_the_autocast_heads_loss():
    """Under autocast the head's matmul runs in bfloat16 whatever the inputs' dtype, so the
    chunks cannot share a buffer of the inputs' dtype: each gets its own, as the plain head's
    logits (the Trainer's amp runs the unit's forward like this)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, None, targets, 8)
        ref = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
        log_probs = linear_log_probs(hidden, weight, None, targets, 8)
        ref_log_probs = F.linear(hidden, weight).float().log_softmax(-1)[torch.arange(37),
                                                                          targets]
    # reason: the same bf16 logits; 37 rows' losses, each a log-sum-exp over 50 of them, in
    # float32 by chunk and whole: relative (log-probs to their scale)
    rel = reordered_sum_rtol(ROWS + CLASSES)
    assert got.item() == pytest.approx(ref.item(), rel=rel, abs=0)
    torch.testing.assert_close(log_probs, ref_log_probs, rtol=0,
                               atol=rel * ref_log_probs.abs().max().item())
    log_probs_gap = ((log_probs - ref_log_probs).abs().max()
                     / (rel * ref_log_probs.abs().max())).item()
    print(f"gap (of float32's allowance): loss {abs(got.item() / ref.item() - 1) / rel:.2f}, "
          f"log-probs {log_probs_gap:.2f}")
    got_grads = torch.autograd.grad(got, (hidden, weight))
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    for a, b in zip(got_grads, ref_grads, strict=True):
        # bf16 matmuls: the weight's gradient summed over chunks in float32, the reference's
        # in one bf16 product; within bf16's resolution (2^-8) of the largest entry
        assert (a - b).abs().max().item() <= 2 ** -8 * b.abs().max().item()


def loss_and_grads_of(compute, tensors) -> tuple[float, list[torch.Tensor]]:
    for t in tensors:
        t.grad = None
    loss = compute()
    loss.backward()
    return loss.item(), [t.grad.clone() for t in tensors]


def test_chunked_loss_refuses_a_model_that_changes_its_logits_after_the_head():
    torch.manual_seed(0)
    gemma2 = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="loss_chunk_size: Gemma2ForCausalLM changes its "
                                         "logits after its head"):
        CausalLMUnit(gemma2, loss_chunk_size=16)  # refused by its config, before it runs
    assert auto_loss_chunk_size(gemma2) is None  # "auto" takes the plain path
    # The kept-position head applies the soft-capping (it runs the model's own code).
    assert_same(loss_and_grads(gemma2, lambda: CausalLMUnit(gemma2)(packed(), MetricBag())[0]),
                loss_and_grads(gemma2, lambda: full_head_loss(gemma2, packed())))


def tp_llama(directory, gangs) -> torch.nn.Module:
    from gangtrain.models.hf import load_pretrained

    return load_pretrained(directory, gangs, data_parallel=None)


def tp_gpt(gangs) -> torch.nn.Module:
    from gangtrain.models.gpt.parallelize import gpt_tensor_parallel

    model = gpt()
    gpt_tensor_parallel(model, gangs)  # attention and feed-forward split, head replicated
    assert isinstance(model.layers[0].attention.wq.weight, DTensor)
    return model


def tp_loss_and_grads(build, batch, chunk):
    """On each of 2 ranks: (the unit's loss and gradients, the full head's), under TP2."""
    from gangs import setup_gangs, setup_root_gang

    model = build(setup_gangs(setup_root_gang(), tp_size=2))
    if chunk is not None:
        with pytest.raises(ValueError, match="loss_chunk_size: LlamaForCausalLM's head is "
                                             "sharded"):
            CausalLMUnit(model, loss_chunk_size=chunk)
    unit = CausalLMUnit(model)
    calls = []
    model.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: calls.append(args[0].shape[0]))
    kept = loss_and_grads(model, lambda: unit(batch, MetricBag())[0])
    assert calls == [int((batch["labels"][:, 1:] != -100).sum())]
    full = loss_and_grads(model, lambda: full_head_loss(model, batch))
    return [(loss, {n: g.full_tensor() if isinstance(g, DTensor) else g
                    for n, g in grads.items()}) for loss, grads in (kept, full)]


@pytest.mark.parametrize(("family", "layout"), [("hf_llama", "packed"), ("hf_llama", "padded"),
                                                ("gpt", "packed")])
def test_trained_position_head_under_tp2_gives_one_processs_full_head(tmp_path, family,
                                                                      layout):
    """Llama's TP plan splits lm_head by vocabulary and gathers its output: the kept
    positions go through it as [n, d] rows. The GPT's plan splits its blocks and replicates
    its head."""
    model, batch = (llama(), gpt())[family == "gpt"], (packed(), padded())[layout == "padded"]
    if family == "gpt":
        build = tp_gpt
    else:
        model.save_pretrained(tmp_path)
        build = partial(tp_llama, tmp_path)
    expected = loss_and_grads(model, lambda: full_head_loss(model, batch))
    chunk = 16 if (family, layout) == ("hf_llama", "packed") else None
    for kept, full in run_ranks(partial(tp_loss_and_grads, build, batch, chunk), world_size=2):
        assert_same(kept, full)  # the same layout: only the head's rows differ
        assert_same(kept, expected, rel=TP_REL)  # against one process
