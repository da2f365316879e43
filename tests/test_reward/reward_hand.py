"""A reward model's loss, gradient and ranking by hand: float64, one pair at a time, unpadded,
the tokens from `apply_chat_template` itself (`hand.answer_tokens` of the preference tests'
kind: the ChatML template, an independent reference for the rendering), the score read as
``score.weight @ last hidden state of the last token`` (independent of transformers' pad
rule), the loss written out with `math`."""

from __future__ import annotations

import math
from typing import Any

import torch

from gangtrain.tiny.chat import CHATML_TEMPLATE_WITH_GENERATION


def side_ids(tokenizer: Any, prompt: Any, answer: Any) -> list[int]:
    """The ids of a prompt and one answer, as the recipe encodes them (text: the prompt's
    tokens, the answer's, the end token; messages: the chat template)."""
    if isinstance(answer, str):
        return (tokenizer(prompt, add_special_tokens=False)["input_ids"]
                + tokenizer(answer, add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id])
    return list(tokenizer.apply_chat_template(
        [*prompt, *answer], tokenize=True, return_dict=True,
        chat_template=CHATML_TEMPLATE_WITH_GENERATION)["input_ids"])


def score(model: Any, ids: list[int]) -> torch.Tensor:
    """The score of one unpadded sequence: the head on the last token's hidden state."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return model.score.weight[0] @ hidden


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def step_by_hand(model: Any, tokenizer: Any, pairs: list[dict[str, Any]],
                 coefficient: float | None) -> dict[str, Any]:
    """The mean loss over `pairs`, its gradient (autograd of the summed losses, divided
    after: as the Trainer divides), the metrics; `model` in float64."""
    model.zero_grad(set_to_none=True)
    losses, chosen, rejected = [], [], []
    total = None
    for pair in pairs:
        r_c, r_r = (score(model, side_ids(tokenizer, pair["prompt"], pair[side]))
                    for side in ("chosen", "rejected"))
        margin = float(pair.get("margin", 0.0))
        diff = r_c - r_r - margin
        term = -torch.nn.functional.logsigmoid(diff)
        c, r = float(r_c.detach()), float(r_r.detach())
        loss = -log_sigmoid(c - r - margin)  # written out: the value checked on its own
        if coefficient is not None:
            term = term + coefficient * (r_c + r_r) ** 2
            loss += coefficient * (c + r) ** 2
        total = term if total is None else total + term
        losses.append(loss)
        chosen.append(c)
        rejected.append(r)
    assert total is not None
    total.backward()
    n = len(pairs)
    grads = {k: p.grad / n for k, p in model.named_parameters() if p.grad is not None}
    return {"loss": sum(losses) / n, "grads": grads,
            "grad_norm": math.sqrt(sum(float((g ** 2).sum()) for g in grads.values())),
            "accuracy": sum(c > r for c, r in zip(chosen, rejected, strict=True)) / n,
            "rewards/chosen": sum(chosen) / n, "rewards/rejected": sum(rejected) / n}


@torch.no_grad()
def ranked_right(model: Any, tokenizer: Any, pairs: list[dict[str, Any]]) -> int:
    """How many pairs `model` (as loaded, its own dtype) scores chosen above rejected,
    strictly, each side alone through the model's own forward."""
    right = 0
    for pair in pairs:
        r_c, r_r = (float(model(torch.tensor([side_ids(tokenizer, pair["prompt"], pair[s])]))
                          .logits[0, 0]) for s in ("chosen", "rejected"))
        right += r_c > r_r
    return right
