"""The must-show of multi-turn training (#70): on replayed multi-turn trajectories (two
sampled turns around a tool result, the results of unequal lengths, one trajectory truncated
by its budget), for dapo, grpo and dr_grpo, the loss the Trainer logs and the gradient its
optimizer sees at both updates of the window equal a float64 computation over the SAMPLED
tokens only, one trajectory at a time (written here from the formulas, not gangtrain's code):
tool results and turn markers are neither targets nor counted; a trajectory's length is its
sampled tokens (grpo's mean, dapo's count), dr_grpo divides by the token budget."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from grpo_hand import advantages
from test_grpo_exact import LR, RecordingSGD
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts
from trainer import Trainer
from trainer.observe.recorders import read_jsonl
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts
from units.reference import ReferenceModel

G, BUDGET, TEMPERATURE, BETA = 4, 12, 0.7, 0.05
# (first turn, tool result, second turn) token counts; trajectory 5's second turn is cut
# by the budget (3 + 9 = 12 sampled tokens, no stop); group 1's rewards differ
SHAPES = [(3, 4, 2), (5, 1, 4), (2, 7, 3), (4, 2, 5), (1, 9, 1), (3, 5, 9), (6, 3, 2),
          (2, 6, 4)]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.25, 1.0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent_loss")
    model_dir = make_tiny_chat_model(base / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = read_prompts([write_prompts(base / "prompts.jsonl", 2)], tokenizer,
                           max_prompt_tokens=200)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    g = torch.Generator().manual_seed(5)
    records = []
    for c, ((first, result, second), reward) in enumerate(zip(SHAPES, REWARDS, strict=True)):
        def draw(n):
            return torch.randint(3, 300, (n,), generator=g).tolist()

        turn1, tool, turn2 = draw(first), draw(result), draw(second)
        turn1[-1] = stop
        truncated = first + second == BUDGET
        if not truncated:
            turn2[-1] = stop
        records.append({
            "window": 0, "prompt_index": c // G, "sample_index": c % G,
            "prompt_ids": list(prompts[c // G].ids), "completion_ids": turn1 + tool + turn2,
            "completion_mask": [1] * first + [0] * result + [1] * second,
            "logprobs": [0.0] * (first + result + second), "truncated": truncated,
            "messages": [{"role": "assistant", "content": "x"},
                         {"role": "tool", "name": "t", "content": "y"},
                         {"role": "assistant", "content": "z"}],
            "rewards": {"r": reward}})
    replay = base / "replay"
    replay.mkdir()
    (replay / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return model_dir, prompts, records, base


def sampled_logps(model, record) -> torch.Tensor:
    """float64 log-probs of the trajectory's sampled tokens, from one forward of its context."""
    prompt, ids = record["prompt_ids"], record["completion_ids"]
    x = torch.tensor([prompt + ids])
    logp = (model(input_ids=x, use_cache=False).logits[0].double() / TEMPERATURE).log_softmax(-1)
    at = [len(prompt) + t for t, m in enumerate(record["completion_mask"]) if m]
    return torch.stack([logp[t - 1, x[0, t]] for t in at])


def hand_loss(model, reference, old_model, records, adv, kind: str, epsilon_high: float):
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    for record, a in zip(records, adv, strict=True):
        logp = sampled_logps(model, record)
        old = logp.detach() if old_model is None else sampled_logps(old_model, record).detach()
        ref = sampled_logps(reference, record).detach()
        ratio = torch.exp(logp - old)
        per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1 + epsilon_high) * a)
        per_token = per_token + BETA * (torch.exp(ref - logp) - (ref - logp) - 1)
        total = total + {"grpo": per_token.mean(), "dapo": per_token.sum(),
                         "dr_grpo": per_token.sum() / BUDGET}[kind]
        tokens += len(logp)
    return total / (tokens if kind == "dapo" else len(records))


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_multi_turn_loss_and_gradient_are_over_sampled_tokens_only(tiny, kind, tmp_path):
    model_dir, prompts, records, base = tiny
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # a reference away from the policy: KL and its gradient at step 1
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    start = copy.deepcopy(policy)
    epsilon_high = 0.28 if kind == "dapo" else 0.2
    scale = "none" if kind == "dr_grpo" else "group"
    loss = GRPOLoss(kind=kind, beta=BETA, num_iterations=2, max_new_tokens=BUDGET,
                    epsilon_high=epsilon_high, scale_rewards=scale)
    unit = GRPOUnit(policy, loss, prompts, [], Rollouts(replay=read_replay(base / "replay")),
                    num_generations=G, batch_size=4, window=2, num_accumulate=2,
                    temperature=TEMPERATURE, pad_id=0,
                    reference=ReferenceModel(policy, reference))
    optimizer = RecordingSGD(policy.parameters(), LR)
    out = tmp_path / "out"
    Trainer(unit, PromptWindows(2, 2, 4, shuffle=False), optimizer, output_dir=out,
            max_num_steps=2, num_accumulate=2, publish_metrics_every_n_steps=1, dtype="fp32",
            progress=False, seed=0).run()
    logged = {r["step"]: r for r in read_jsonl(out / "metrics" / "train.jsonl")}
    adv = advantages(REWARDS, G, scale, kind)
    model0, ref64 = copy.deepcopy(start).double(), copy.deepcopy(reference).double()
    model1 = copy.deepcopy(start)
    with torch.no_grad():
        for p, g in zip(model1.parameters(), optimizer.seen[0], strict=True):
            p.add_(g, alpha=-LR)  # SGD's own float32 update
    model1 = model1.double()
    for step, (model, old) in enumerate(((model0, None), (model1, model0)), start=1):
        hand = hand_loss(model, ref64, old, records, adv, kind, epsilon_high)
        expected = torch.autograd.grad(hand, list(model.parameters()), allow_unused=True)
        largest = max(float(e.abs().max()) for e in expected if e is not None)
        for got, want in zip(optimizer.seen[step - 1], expected, strict=True):
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
            # float32 forward against float64: the reductions are short (tens of tokens,
            # hidden 64), so 1e-6 of the largest entry holds with a wide margin
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * largest)
        assert logged[step]["loss"] == pytest.approx(float(hand.detach()), rel=1e-6, abs=1e-7)
    # the window opens at step 1: a trajectory's length is its sampled tokens, dapo's
    # targets are the window's sampled tokens, the truncated one is counted as clipped
    sampled = [first + second for first, _, second in SHAPES]
    assert logged[1]["completions/mean_length"] == pytest.approx(sum(sampled) / 8)
    assert logged[1]["completions/max_length"] == BUDGET
    assert logged[1]["completions/clipped_ratio"] == pytest.approx(1 / 8)
    if kind == "dapo":
        assert logged[1]["num_targets"] == sum(sampled)
