"""The GRPO family's loss of one optimizer step by hand: float64, one completion at a time,
from the formulas of TRL's `GRPOTrainer` / `RLOOTrainer` written out again (not gangtrain's
code): group advantages with Bessel's std + 1e-4, the clipped ratio, k3 KL, and each kind's
normalisation over the step's completions.

`step_loss(model, reference, old, completions, rewards, ...)` returns the loss as a float64
tensor with a graph to ``model``'s float64 parameters: its value and `torch.autograd.grad`
are the Trainer's loss and the gradient its optimizer sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_logps(model, prompt: Sequence[int], completion: Sequence[int], temperature: float):
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids, use_cache=False).logits[0].double() / temperature
    logp = logits.log_softmax(-1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return torch.stack([logp[t, ids[0, t + 1]] for t in positions])


def advantages(rewards: list[float], group: int, scale: str, kind: str) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        r = torch.tensor(rewards[start:start + group], dtype=torch.float64)
        if kind == "rloo":
            out += [float(r[i] - (r.sum() - r[i]) / (group - 1)) for i in range(group)]
            continue
        mean = r.mean()
        if scale == "group":
            std = ((r - mean) ** 2).sum().div(group - 1).sqrt()
        elif scale == "batch":
            every = torch.tensor(rewards, dtype=torch.float64)
            std = ((every - every.mean()) ** 2).sum().div(len(rewards) - 1).sqrt()
        out += [float((x - mean) / (std + 1e-4)) if scale != "none" else float(x - mean)
                for x in r]
    return out


def step_loss(model, reference, old_model, completions, adv, *, kind: str, beta: float,
              epsilon: float, epsilon_high: float, max_new_tokens: int, temperature: float,
              kept: Sequence[bool]):
    """The loss of one step over ``completions`` [(prompt ids, completion ids)] with
    advantages ``adv``; ``old_model`` None: the ratio is 1 (old = current, detached)."""
    total = torch.zeros((), dtype=torch.float64)
    sequences = tokens = 0
    for (prompt, completion), a, keep in zip(completions, adv, kept, strict=True):
        if not keep:
            continue
        logp = token_logps(model, prompt, completion, temperature)
        old = logp.detach() if old_model is None else \
            token_logps(old_model, prompt, completion, temperature).detach()
        if kind == "rloo":
            ratio = torch.exp((logp - old).sum())
            clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
            total = total - torch.minimum(ratio * a, clipped * a)
            sequences += 1
            continue
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
        per_token = -torch.minimum(ratio * a, clipped * a)
        if beta > 0:
            ref = token_logps(reference, prompt, completion, temperature).detach()
            per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        if kind == "grpo":
            total = total + per_token.mean()
        elif kind == "dr_grpo":
            total = total + per_token.sum() / max_new_tokens
        else:
            total = total + per_token.sum()
        sequences += 1
        tokens += len(completion)
    return total / (tokens if kind == "dapo" else sequences)


def kl_penalised(rewards: list[float], completions, old_model, reference, beta: float,
                 temperature: float) -> list[float]:
    """RLOO's rewards less beta times each completion's k1 KL sum (old - ref)."""
    out = []
    for r, (prompt, completion) in zip(rewards, completions, strict=True):
        with torch.no_grad():
            old = token_logps(old_model, prompt, completion, temperature)
            ref = token_logps(reference, prompt, completion, temperature)
        out.append(r - beta * float((old - ref).sum()))
    return out
