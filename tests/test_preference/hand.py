"""Preference losses and TRL's reward metrics computed by hand: float64 models, one pair at a
time, tokens and answer masks from `apply_chat_template` itself (the ChatML template with
`{% generation %}` markers, an independent reference for which tokens are scored), the
formulas written out with `math`. The tests hold `units.preference` and the recipe to it."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from gangtrain.tiny.chat import CHATML_TEMPLATE_WITH_GENERATION


def answer_tokens(tokenizer: Any, prompt: Any, answer: Any) -> tuple[list[int], list[int]]:
    """(ids, 1 where the token is scored) of a prompt and one answer."""
    if isinstance(answer, str):
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tail = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return head + tail, [0] * len(head) + [1] * len(tail)
    out = tokenizer.apply_chat_template(
        [*prompt, *answer], tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        chat_template=CHATML_TEMPLATE_WITH_GENERATION)
    return list(out["input_ids"]), list(out["assistant_masks"])


_SEEN: dict[tuple[int, str], tuple[float, int]] = {}


@torch.no_grad()
def answer_logp(model: Any, tokenizer: Any, prompt: Any, answer: Any) -> tuple[float, int]:
    """(sum of log p(token | before) over the answer's tokens, their count), in float64;
    remembered per model object and pair until `forget`."""
    key = (id(model), json.dumps([prompt, answer]))
    if key not in _SEEN:
        _SEEN[key] = _answer_logp(model, tokenizer, prompt, answer)
    return _SEEN[key]


def forget() -> None:
    """Drop what `answer_logp` remembers (before models change or are made afresh)."""
    _SEEN.clear()


def _answer_logp(model: Any, tokenizer: Any, prompt: Any, answer: Any) -> tuple[float, int]:
    ids, scored = answer_tokens(tokenizer, prompt, answer)
    logits = model(torch.tensor([ids])).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    keep = torch.tensor(scored[1:], dtype=torch.bool)
    return float(logp[keep].sum()), int(keep.sum())


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def pair_by_hand(kind: str, pair: dict[str, Any], policy: Any, reference: Any, tokenizer: Any,
                 beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                 rpo_alpha: float | None = None) -> dict[str, float]:
    """{"loss", "rewards/...", "logps/..."} of one pair (TRL's formulas)."""
    prompt = pair.get("prompt")
    chosen, rejected = pair["chosen"], pair["rejected"]
    if prompt is None:  # implicit: the shared messages
        n = next(i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    (pc, nc), (pr, nr) = (answer_logp(policy, tokenizer, prompt, a) for a in (chosen, rejected))
    avg_c, avg_r = pc / nc, pr / nr
    s = label_smoothing
    if kind in ("dpo", "ipo"):
        (rc, _), (rr, _) = (answer_logp(reference, tokenizer, prompt, a)
                            for a in (chosen, rejected))
        if kind == "ipo":
            pc, pr, rc, rr = avg_c, avg_r, rc / nc, rr / nr
        h = (pc - rc) - (pr - rr)
        reward_c, reward_r = beta * (pc - rc), beta * (pr - rr)
        loss = (-(1 - s) * _logsigmoid(beta * h) - s * _logsigmoid(-beta * h) if kind == "dpo"
                else (h - 1 / (2 * beta)) ** 2)
    else:
        pc, pr = avg_c, avg_r
        reward_c, reward_r = beta * pc, beta * pr
        if kind == "simpo":
            g = pc - pr - simpo_gamma / beta
            loss = -(1 - s) * _logsigmoid(beta * g) - s * _logsigmoid(-beta * g)
        else:
            log_odds = (pc - pr) - (math.log1p(-math.exp(pc)) - math.log1p(-math.exp(pr)))
            loss = -pc - beta * _logsigmoid(log_odds)
    if rpo_alpha is not None:
        loss += rpo_alpha * -avg_c
    return {"loss": loss, "rewards/chosen": reward_c, "rewards/rejected": reward_r,
            "rewards/margins": reward_c - reward_r,
            "rewards/accuracies": float(reward_c > reward_r),
            "logps/chosen": pc, "logps/rejected": pr}


def mean_by_hand(kind: str, pairs: list[dict[str, Any]], policy: Any, reference: Any,
                 tokenizer: Any, **settings: Any) -> dict[str, float]:
    """The means over ``pairs`` of `pair_by_hand`, the models in float64."""
    policy, reference = policy.double().eval(), reference.double().eval()
    rows = [pair_by_hand(kind, p, policy, reference, tokenizer, **settings) for p in pairs]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
