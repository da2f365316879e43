"""`units.online_rl` through the Trainer on replayed rollouts, against `grpo_hand.py` (float64,
one completion at a time): for each loss kind, with unequal completion lengths, a group whose
rewards are all equal (zero std), a truncated completion, a reference model (beta > 0) and a
second update on the same window (num_iterations 2: the ratio moves and clipping is
active), the loss the Trainer logs and the gradient its optimizer sees equal the hand
computation at both steps."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from grpo_hand import advantages, kl_penalised, step_loss
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts
from trainer import Trainer
from trainer.observe.recorders import read_jsonl
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts
from units.reference import ReferenceModel

G, MAX_NEW = 4, 10
TEMPERATURE = 0.7
LR = 1.0  # plain SGD: big enough that the second update's ratios leave [0.8, 1.28]
# Unequal lengths; completion 5 cut at MAX_NEW (no stop token); group 1 all reward 1.
LENGTHS = [3, 7, 5, 9, 4, MAX_NEW, 6, 2]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0]


def replay_inputs(base):
    """(the tiny chat model's directory, two prompts, its end-of-turn id) under ``base``."""
    model_dir = make_tiny_chat_model(base / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = read_prompts([write_prompts(base / "prompts.jsonl", 2)], tokenizer,
                           max_prompt_tokens=200)
    return model_dir, prompts, tokenizer.convert_tokens_to_ids("<|im_end|>")


def write_replay(base, records):
    """``records`` as step 1's rollouts of a run directory ``base / "replay"``."""
    replay = base / "replay"
    replay.mkdir()
    (replay / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_exact")
    model_dir, prompts, stop = replay_inputs(base)
    generator = torch.Generator().manual_seed(3)
    records = []
    for c, (length, reward) in enumerate(zip(LENGTHS, REWARDS, strict=True)):
        ids = torch.randint(3, 300, (length,), generator=generator).tolist()
        truncated = length == MAX_NEW
        if not truncated:
            ids[-1] = stop
        records.append({"window": 0, "prompt_index": c // G, "sample_index": c % G,
                        "prompt_ids": list(prompts[c // G].ids), "completion_ids": ids,
                        "truncated": truncated, "rewards": {"r": reward}})
    write_replay(base, records)
    return model_dir, prompts, records, base


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps the gradient of every step (what the Trainer normalised)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


CASES = {
    "grpo": dict(kind="grpo", beta=0.05),
    "dapo": dict(kind="dapo", beta=0.05, epsilon_high=0.28),
    "dr_grpo": dict(kind="dr_grpo", beta=0.05, scale_rewards="none"),
    "rloo": dict(kind="rloo", beta=0.05, scale_rewards="none"),
    "grpo_masked_batch": dict(kind="grpo", beta=0.0, scale_rewards="batch",
                              mask_truncated_completions=True),
    "dapo_masked": dict(kind="dapo", beta=0.0, mask_truncated_completions=True),
}


def run_trainer(tiny, case: dict, out):
    model_dir, prompts, records, base = tiny
    from gangtrain.rl.rollouts import read_replay

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # a reference away from the policy: KL and its gradient at step 1
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    start = copy.deepcopy(policy)
    loss = GRPOLoss(**{"num_iterations": 2, "max_new_tokens": MAX_NEW, **case})
    unit = GRPOUnit(policy, loss, prompts, [], Rollouts(replay=read_replay(base / "replay")),
                    num_generations=G, batch_size=4, window=2, num_accumulate=2,
                    temperature=TEMPERATURE, pad_id=0,
                    reference=ReferenceModel(policy, reference) if loss.beta else None)
    optimizer = RecordingSGD(policy.parameters(), LR)
    Trainer(unit, PromptWindows(2, 2, 4, shuffle=False), optimizer, output_dir=out,
            max_num_steps=2, num_accumulate=2, publish_metrics_every_n_steps=1, dtype="fp32",
            progress=False, seed=0).run()
    logged = {r["step"]: r for r in read_jsonl(out / "metrics" / "train.jsonl")}
    return start, reference, optimizer.seen, logged


def assert_both_steps_match(start, grads, logged, hand_loss):
    """Step 1 at the start's weights (ratio 1), step 2 at step 1's (the same window again):
    the logged loss and the optimizer's gradient equal ``hand_loss(model, old_model)``'s
    float64 value and autograd gradient."""
    model0 = copy.deepcopy(start).double()
    model1 = copy.deepcopy(start)
    with torch.no_grad():
        for p, g in zip(model1.parameters(), grads[0], strict=True):
            p.add_(g, alpha=-LR)  # SGD's own float32 update
    model1 = model1.double()
    for step, (model, old) in enumerate(((model0, None), (model1, model0)), start=1):
        hand = hand_loss(model, old)
        expected = torch.autograd.grad(hand, list(model.parameters()), allow_unused=True)
        scale = max(float(e.abs().max()) for e in expected if e is not None)
        for got, want in zip(grads[step - 1], expected, strict=True):
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
            # float32 forward against float64: measured up to ~2e-7 of the largest entry
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * scale)
        assert logged[step]["loss"] == pytest.approx(float(hand.detach()), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_equal_the_hand_computation(tiny, name, tmp_path):
    _, _, records, _ = tiny
    case = CASES[name]
    start, reference, grads, logged = run_trainer(tiny, case, tmp_path / name)
    completions = [(r["prompt_ids"], r["completion_ids"]) for r in records]
    kind, beta = case["kind"], case["beta"]
    epsilon, high = 0.2, case.get("epsilon_high", 0.2)
    kept = [not (case.get("mask_truncated_completions") and r["truncated"]) for r in records]
    model0 = copy.deepcopy(start).double()
    ref64 = copy.deepcopy(reference).double()
    rewards = REWARDS
    if kind == "rloo" and beta:
        rewards = kl_penalised(REWARDS, completions, model0, ref64, beta, TEMPERATURE)
    adv = advantages(rewards, G, case.get("scale_rewards", "group"), kind)
    assert adv[4:] == [0.0] * 4 or kind == "rloo" and beta  # the zero-std group
    assert_both_steps_match(start, grads, logged, lambda model, old: step_loss(
        model, ref64, old, completions, adv, kind=kind, beta=beta, epsilon=epsilon,
        epsilon_high=high, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, kept=kept))
    assert logged[2]["clip_ratio/region_mean"] > 0  # clipping was active at step 2
    if beta:
        assert logged[1]["kl"] > 0
