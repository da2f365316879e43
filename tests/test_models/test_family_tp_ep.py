"""Tensor and expert parallelism of the families of `model_families`, loaded from their
`save_pretrained` directories and trained through the Trainer on forked Gloo ranks: TP2, and
EP2 for the MoE families, equal one process (losses, and each weight's update); the layouts
that cannot be exact are refused by name before anything is allocated; a MoE config that
asks for its router's auxiliary loss trains with it, as the model's own
`forward(labels=...)` computes it."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from family_runs import INPUT_IDS, SEQ_LEN, TRAIN, train_family
from model_families import FAMILIES, MOE_FAMILIES, save_tiny
from ranks import run_ranks
from tolerances import reordered_sum_rtol, sgd_weight_atol
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import export_pretrained, load_pretrained
from trainer.errors import UserError

# One family per way TP splits a model beyond LLaMA's (tests/test_hf): Qwen3 replicates its
# per-head q_norm/k_norm and sums their gradient over TP (as Gemma 3), Phi-3 splits fused
# projections whose output it gathers, GPT-NeoX splits its fused query_key_value under its
# own prefix. Every family, 4 steps: `python -m benchmarks.family_tp_ep`.
TP_FAMILIES = ("qwen3", "phi3", "gpt_neox")
# reason: a step's loss and gradient sum its global batch's 8 x SEQ_LEN positions in float32,
# in another order per layout; TP splits each of the 4 layers' row-parallel sums (<= 64
# terms, intermediate size) in two, EP sums a token's experts in another order; the clipping
# norm's sum adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(8 * SEQ_LEN + 4 * 64 + 32)
# reason: the same weights' logits, the 4 layers' sums (<= 64 terms) and the head's 32 in
# another order: relative to the logits' scale
LOGITS_RTOL = reordered_sum_rtol(4 * 64 + 32)
STEPS = 2  # train_family's default


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_tiny(family, root / family) for family in FAMILIES}


def train_each(saved, root, families, **layout):
    name = "-".join(f"{key}{value}" for key, value in layout.items())
    return {family: train_family(saved[family], root / f"{family}-{name}", **layout)
            for family in families}


def test_tp2_trains_every_family_like_one_process(saved, tmp_path):
    one = run_ranks(partial(train_each, saved, tmp_path, TP_FAMILIES), world_size=1)[0]
    tp2 = run_ranks(partial(train_each, saved, tmp_path, TP_FAMILIES, tp_size=2),
                    world_size=2, timeout=300)[0]
    assert_like_one_process(saved, tp2, one, "TP2")


def test_ep2_trains_moe_families_like_one_process_and_exports(saved, tmp_path):
    """Experts split over 2 EP ranks (which are also 2 FSDP2 ranks), tokens dispatched by
    all-to-all; the checkpoint exports to the trained logits."""
    one = run_ranks(partial(train_each, saved, tmp_path, MOE_FAMILIES), world_size=1)[0]
    ep2 = run_ranks(partial(train_each, saved, tmp_path, MOE_FAMILIES, ep_size=2),
                    world_size=2, timeout=300)[0]
    assert_like_one_process(saved, ep2, one, "EP2")
    for family in MOE_FAMILIES:
        exported = export_pretrained(tmp_path / f"{family}-ep_size2" / "checkpoints",
                                     tmp_path / f"{family}-hf")
        model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            logits = model.eval()(INPUT_IDS).logits
        gap = ((logits - ep2[family].logits).abs().max()
               / (LOGITS_RTOL * logits.abs().max())).item()
        print(f"{family}: |exported logits - EP2 trained logits| {gap:.2f} of allowed")
        assert gap <= 1


def update_gaps(params, reference, initial):
    """Each weight's gap as a fraction of `sgd_weight_atol` (a weight zero and unmoved: exact)."""
    for name, value in reference.items():
        gap = (params[name] - value).abs().max().item()
        atol = sgd_weight_atol((value - initial[name]).abs().max().item(),
                               value.abs().max().item(), GRAD_RTOL, STEPS)
        yield gap / atol if atol else gap * float("inf")


def assert_like_one_process(saved, runs, one, layout):
    """`runs` (rank 0's, by family) train as `one` did: losses within GRAD_RTOL relative,
    each weight's change within its rounding."""
    for family, b in one.items():
        a = runs[family]
        losses = zip(a.train_losses + a.valid_losses, b.train_losses + b.valid_losses,
                     strict=True)
        # reason: losses are sums of positive terms: relative, at the gradient's tolerance
        loss_gap = max(abs(x - y) / abs(y) for x, y in losses) / GRAD_RTOL
        initial = AutoModelForCausalLM.from_pretrained(saved[family]).state_dict()
        # reason: SGD's update is linear in the gradient, so each weight's change differs
        # GRAD_RTOL relative, plus one float32 rounding of the weight a step (a gradient left
        # partial, as Qwen3's k_norm without the sum over TP, is off by ~the change itself)
        update_gap = max(update_gaps(a.params, b.params, initial))
        print(f"{family}: {layout} loss gap {loss_gap:.2f}, update gap {update_gap:.2f} of "
              "allowed")
        assert len(a.train_losses) == STEPS and loss_gap <= 1, family
        assert update_gap <= 1, family


def refusals(saved, gpt2_dir):
    """The UserError each layout raises on 2 ranks, by (family, tp_size, ep_size)."""
    tp2 = setup_gangs(setup_root_gang(), tp_size=2)
    ep2 = setup_gangs(setup_root_gang(), ep_size=2)
    cases = [(family, tp2) for family in (*MOE_FAMILIES, "gpt2")] + [("llama", ep2)]
    messages = {}
    for family, gangs in cases:
        with pytest.raises(UserError) as error:
            load_pretrained(gpt2_dir if family == "gpt2" else saved[family], gangs)
        messages[(family, gangs.tp.size, gangs.ep.size)] = str(error.value)
    return messages


def test_layouts_that_cannot_be_exact_are_refused_by_name(saved, tmp_path):
    # GPT-2 declares no TP plan (fused qkv in a transposed Conv1D: no colwise split fits it).
    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    messages = run_ranks(partial(refusals, saved, tmp_path / "gpt2"), world_size=2)[0]
    for family in MOE_FAMILIES:  # experts fused in 3-D weights: no TP style splits them
        assert "experts" in messages[(family, 2, 1)]
        assert "tp_size 1 and split its experts with gangs.ep_size" in messages[(family, 2, 1)]
    assert "has no experts" in messages[("llama", 1, 2)]
    gpt2 = messages[("gpt2", 2, 1)]
    assert "GPT2LMHeadModel" in gpt2 and "tp_size 1" in gpt2


def first_loss(directory, output_dir):
    return train_family(directory, output_dir, max_num_steps=1).train_losses[0]


def test_router_aux_loss_is_trained_when_the_config_asks(saved, tmp_path):
    """Qwen3-MoE with `output_router_logits` trains on cross-entropy + coef * aux loss: the
    Trainer's first loss equals the model's own `forward(labels=...)` loss."""
    directory = tmp_path / "aux"
    save_tiny("qwen3_moe", directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=0.5)
    (directory / "config.json").write_text(json.dumps(config))
    trained = run_ranks(partial(first_loss, directory, tmp_path / "run"), world_size=1)[0]

    model = AutoModelForCausalLM.from_pretrained(directory)
    batch = {k: v[:8] for k, v in TRAIN.items()}  # the first global batch, unshuffled
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        output = model(**batch, labels=labels, use_cache=False)
    print(f"trained {trained}, model's own {output.loss.item()} "
          f"(of which 0.5 * aux loss {output.aux_loss.item()})")
    # One float32 cross-entropy over ~80 targets, summed then divided vs averaged (measured
    # 1.2e-7 relative); without the aux loss the gap would be 0.5 * aux ~ 1.
    assert abs(trained - output.loss.item()) <= 1e-6 * abs(trained)
    assert 0.5 * output.aux_loss.item() > 0.1
