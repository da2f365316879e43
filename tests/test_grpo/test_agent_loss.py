"""The must-show of multi-turn training (#70): on replayed multi-turn trajectories (two
sampled turns around a tool result, the results of unequal lengths, one trajectory truncated
by its budget), for dapo, grpo and dr_grpo, the loss the Trainer logs and the gradient its
optimizer sees at both updates of the window equal a float64 computation over the SAMPLED
tokens only, one trajectory at a time (written here from the formulas, not gangtrain's code):
tool results and turn markers are neither targets nor counted; a trajectory's length is its
sampled tokens (grpo's mean, dapo's count), dr_grpo divides by the token budget."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_hand import advantages
from test_grpo_exact import (
    TEMPERATURE,
    assert_both_steps_match,
    replay_inputs,
    run_trainer,
    write_replay,
)

G, BUDGET, BETA = 4, 12, 0.05
# (first turn, tool result, second turn) token counts; trajectory 5's second turn is cut
# by the budget (3 + 9 = 12 sampled tokens, no stop); group 1's rewards differ
SHAPES = [(3, 4, 2), (5, 1, 4), (2, 7, 3), (4, 2, 5), (1, 9, 1), (3, 5, 9), (6, 3, 2),
          (2, 6, 4)]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.25, 1.0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent_loss")
    model_dir, prompts, stop = replay_inputs(base)
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
    write_replay(base, records)
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
    _, _, records, _ = tiny
    epsilon_high = 0.28 if kind == "dapo" else 0.2
    scale = "none" if kind == "dr_grpo" else "group"
    start, reference, seen, logged = run_trainer(
        tiny, dict(kind=kind, beta=BETA, max_new_tokens=BUDGET, epsilon_high=epsilon_high,
                   scale_rewards=scale), tmp_path / "out")
    adv = advantages(REWARDS, G, scale, kind)
    ref64 = copy.deepcopy(reference).double()
    assert_both_steps_match(start, seen, logged, lambda model, old: hand_loss(
        model, ref64, old, records, adv, kind, epsilon_high))
    # the window opens at step 1: a trajectory's length is its sampled tokens, dapo's
    # targets are the window's sampled tokens, the truncated one is counted as clipped
    sampled = [first + second for first, _, second in SHAPES]
    assert logged[1]["completions/mean_length"] == pytest.approx(sum(sampled) / 8)
    assert logged[1]["completions/max_length"] == BUDGET
    assert logged[1]["completions/clipped_ratio"] == pytest.approx(1 / 8)
    if kind == "dapo":
        assert logged[1]["num_targets"] == sum(sampled)
