"""KTO by hand: float64 models, one sequence at a time, unpadded, the tokens and the scored
completion tokens from `apply_chat_template` itself (the ChatML template with generation
markers), the KL partners by TRL's rotation (example j with completion j-1 of its global
micro-batch), the estimate over the whole step, clamped at 0, the loss written out with
`math` and its gradient by autograd of the summed losses divided after (as the Trainer)."""

from __future__ import annotations

import math
from typing import Any

import torch

from gangtrain.tiny.chat import CHATML_TEMPLATE_WITH_GENERATION


def encode(tokenizer: Any, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
    """(ids, 1 where scored) of a prompt and its completion."""
    if isinstance(completion, str):
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
        tail = tail + [tokenizer.eos_token_id]
        return head + tail, [0] * len(head) + [1] * len(tail)
    out = tokenizer.apply_chat_template(
        [*prompt, *completion], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True, chat_template=CHATML_TEMPLATE_WITH_GENERATION)
    return list(out["input_ids"]), list(out["assistant_masks"])


def logp(model: Any, ids: list[int], scored: list[int]) -> torch.Tensor:
    """Sum of log p(token | before) over the scored tokens."""
    logits = model(torch.tensor([ids])).logits[0, :-1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (log_probs * torch.tensor(scored[1:], dtype=log_probs.dtype)).sum()


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def step_by_hand(policy: Any, reference: Any, tokenizer: Any, micro_batches: list[list[dict]],
                 beta: float, desirable_weight: float, undesirable_weight: float
                 ) -> dict[str, Any]:
    """The step's mean loss, KL estimate and gradient over its global micro-batches."""
    encoded = [[encode(tokenizer, e["prompt"], e["completion"]) for e in g]
               for g in micro_batches]
    kl_terms = []
    with torch.no_grad():
        for g in encoded:
            for j, (ids, scored) in enumerate(g):
                p = scored.index(1)
                other_ids, other_scored = g[(j - 1) % len(g)]
                q = other_scored.index(1)
                row, mask = ids[:p] + other_ids[q:], [0] * p + other_scored[q:]
                kl_terms.append(float(logp(policy, row, mask)) - float(logp(reference, row,
                                                                             mask)))
    kl = max(sum(kl_terms) / len(kl_terms), 0.0)
    policy.zero_grad(set_to_none=True)
    losses, total = [], None
    for g, examples in zip(encoded, micro_batches, strict=True):
        for (ids, scored), example in zip(g, examples, strict=True):
            pi = logp(policy, ids, scored)
            with torch.no_grad():
                ref = float(logp(reference, ids, scored))
            z = beta * (pi - ref - kl)
            if example["label"]:
                term = desirable_weight * (1 - torch.sigmoid(z))
                losses.append(desirable_weight * (1 - sigmoid(float(z.detach()))))
            else:
                term = undesirable_weight * (1 - torch.sigmoid(-z))
                losses.append(undesirable_weight * (1 - sigmoid(-float(z.detach()))))
            total = term if total is None else total + term
    assert total is not None
    total.backward()
    n = len(losses)
    grads = {k: p.grad / n for k, p in policy.named_parameters() if p.grad is not None}
    return {"loss": sum(losses) / n, "kl": kl, "grads": grads,
            "grad_norm": math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))}
