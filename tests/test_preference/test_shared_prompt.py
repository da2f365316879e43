"""Each pair's prompt run once (`units.shared_prompt`): every answer token's log-probability
and the gradient are those of the whole rows' forward (float64, each family by hand from its
logits), the batch padded on the right with answers of different lengths; the Trainer's
run equals the one with whole rows; what cannot share runs whole."""

from __future__ import annotations

import tempfile

import pytest
import torch
from model_families import FAMILIES, MOE_FAMILIES, tiny_model
from tolerances import reordered_sum_rtol, sgd_weight_atol

from gangs import FakeGang, setup_gangs
from gangtrain.data.collate import IGNORE_INDEX, padded_batch
from gangtrain.parallel.blocks import checkpoint_blocks, find_blocks
from trainer.trainer import Trainer
from units import shared_prompt
from units.preference import PreferenceLoss, PreferenceUnit, side_logps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PROMPT = 20


def pairs_batch(seed: int = 0, prompt: int = PROMPT) -> dict[str, torch.Tensor]:
    """3 pairs, prompts of `prompt` to `prompt` + 2 tokens, answers of 3 to 12 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (prompt + i,), generator=generator).tolist()
               for i in range(3)]
    sides = []
    for side in range(2):
        for i, ids in enumerate(prompts):
            answer = torch.randint(3, 128, (3 + 3 * i + 2 * side,), generator=generator)
            sides.append((ids + answer.tolist(), [False] * len(ids) + [True] * len(answer)))
    return padded_batch(sides, pad_id=0)


def by_hand(model, batch):
    """Each row's summed answer log-probability from the whole rows' logits."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_probs = logits[:, :-1].double().log_softmax(-1)
    targets = batch["labels"][:, 1:]
    trained = targets != IGNORE_INDEX
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (picked * trained).sum(-1)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"] + ["stablelm"])
def test_log_probs_and_gradients_equal_the_whole_rows(family):
    model = tiny_model(family)
    dtype = torch.float32 if family in MOE_FAMILIES else torch.float64  # grouped_mm: no f64
    model.to(dtype)
    batch = pairs_batch()
    assert shared_prompt.shared_prompt_length(model, batch) == PROMPT
    parameters = [p for p in model.parameters() if p.requires_grad]

    shared, counts = side_logps(model, batch)
    grads = torch.autograd.grad(shared.sum(), parameters, allow_unused=True)
    expected = by_hand(model, batch)
    expected_grads = torch.autograd.grad(expected.sum(), parameters, allow_unused=True)

    assert torch.equal(counts, (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1))
    # The answers' log-probabilities are float32 (`linear_log_probs`) whatever the model's
    # dtype. A cache at the wrong positions, rows or length moves them by 1e-2 and more.
    # reason: a row sums its answer tokens' float32 log-probs (all < 0: relative), each a
    # log-softmax adding ~2 roundings of |log-prob|: two more terms' worth, against float64
    rtol = reordered_sum_rtol(int(counts.max()) + 2)
    torch.testing.assert_close(shared.double(), expected, rtol=rtol, atol=0)
    # reason: a gradient sums the batch's answer tokens' float32 contributions, relative to
    # its largest entry
    grad_rtol = reordered_sum_rtol(int(counts.sum()))
    for got, want in zip(grads, expected_grads, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            assert (got.double() - want.double()).abs().max().item() \
                <= grad_rtol * want.double().abs().max().item()


def test_what_cannot_share_runs_whole():
    model = tiny_model("llama")
    batch = pairs_batch()
    assert shared_prompt.shared_prompt_length(model, pairs_batch(prompt=10)) == 0  # short
    assert shared_prompt.shared_prompt_length(
        model, {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}) == 0
    assert shared_prompt.shared_prompt_length(tiny_model("gemma2"), batch) == 0  # soft-capped
    differing = {k: v.clone() for k, v in batch.items()}
    differing["input_ids"][3, 5] += 1  # pair 0's sides part at position 5
    assert shared_prompt.shared_prompt_length(model, differing) == 0
    checkpoint_blocks(find_blocks(model))  # recomputed blocks would run on the grown cache
    assert shared_prompt.shared_prompt_length(model, batch) == 0


def _trained(model, reference, shares: bool, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(shared_prompt, "MIN_SHARED_PROMPT", 16 if shares else 10**6)
    calls = []
    original = shared_prompt.shared_prompt_logps
    monkeypatch.setattr("units.preference.shared_prompt_logps",
                        lambda *args: calls.append(1) or original(*args))

    class Batches:
        def __iter__(self):
            for seed in range(4):
                yield pairs_batch(seed)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # differences stay linear
    with tempfile.TemporaryDirectory() as out:
        Trainer(PreferenceUnit(model, PreferenceLoss("dpo", beta=0.5), reference), Batches(),
                optimizer, output_dir=out, gangs=setup_gangs(FakeGang()), max_num_steps=4,
                max_gradient_norm=1.0, recorders=[], progress=False).run()
    assert len(calls) == (8 if shares else 0)  # policy and reference, 4 steps
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_dpo_run_equals_the_one_with_whole_rows(monkeypatch):
    runs = [_trained(tiny_model("qwen2"), tiny_model("qwen2"), shares, monkeypatch)
            for shares in (True, False)]
    start = tiny_model("qwen2").state_dict()
    moved = max((value - start[name]).abs().max().item() for name, value in runs[1].items())
    assert moved > 1e-3
    # reason: SGD is linear in the gradient, a float32 sum over a batch's answer tokens (+2
    # roundings of each log-softmax): the moves differ that relative, plus one float32
    # rounding of the weight a step
    rtol = reordered_sum_rtol(int((pairs_batch()["labels"] != IGNORE_INDEX).sum()) + 2)
    for name, value in runs[1].items():
        atol = sgd_weight_atol((value - start[name]).abs().max().item(),
                               value.abs().max().item(), rtol, 4)
        torch.testing.assert_close(runs[0][name], value, rtol=0, atol=atol, msg=name)
