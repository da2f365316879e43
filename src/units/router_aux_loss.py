"""The router's auxiliary (load-balancing) loss of a Hugging Face mixture-of-experts model,
added to the trained loss when the model's config asks for it (`output_router_logits`, with
weight `router_aux_loss_coef`), as the model's own `forward(labels=...)` adds it to its mean
loss: the unit sums its loss over targets, so it adds `coef * aux_loss * num_targets`.

transformers' `load_balancing_loss_func` (Switch Transformer's, pooled over the layers):

    aux = E * sum_e f_e * P_e     f_e = tokens routed to e / R,  P_e = router probability of e
                                  summed over the tokens / R,   R = tokens x layers
                                  (padding, attention mask 0, left out)

The global-batch rule: a micro-batch's `aux` is that of the tokens of every data-parallel
(and context-parallel) rank's micro-batch together, the loss one process holding them all
computes, whatever the layout. `f` is not differentiable (top-k choices): each rank's counts,
token count `R` and target count are summed over those ranks (one all-reduce of E + 2
numbers per micro-batch, on the device), and each rank adds

    coef * n * E * sum_e f_e * p_e / R       (n, f, R global; p_e its own probability sums)

so that the ranks' shares add up to `coef * n * aux` of the global micro-batch, and its
gradient reaches each router through the rank's own tokens. Computed per rank instead (as
transformers' own data-parallel training does), DP2 would train another objective than one
process: a product of two means over half the tokens is not that over all of them. As
Megatron-Core's `global_aux_loss` (counts reduced over tp x dp x cp) and the global-batch
balancing of Qwen's "Demons in the Detail" (2025); tensor-parallel ranks see the same tokens
and take no part.

The ranks are those `share_router_statistics(model, gangs)` names (`gangtrain.models.hf.load_pretrained`
names `gangs.dp` and `gangs.cp`); a model under a process group that names none is refused,
never trained per rank silently. The first forward checks the formula against the model's
own `aux_loss` (one host sync): a family whose aux loss is another is refused by name.

`ExpertLayersAuxLoss` applies the same rule, through the same lookup and all-reduce, to the
`layers.moe.MoEFeedForward` layers of the LM recipe's MoE (Switch's loss per layer, summed
over the layers; `recipes.lm.recipe.build_model` names `gangs.dp` and `gangs.cp`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gangs import Gang, ReduceOperation
from gangtrain.layers.moe import MoEFeedForward, load_balancing_loss
from gangtrain.layers.wrappers import unwrapped, wrapped_chain

__all__ = ["ROUTER_STATISTICS_GANGS", "ExpertLayersAuxLoss", "RouterAuxLoss",
           "also_share_router_statistics",
           "router_statistics_gangs", "share_router_statistics", "summed_over_gangs"]

ROUTER_STATISTICS_GANGS = "router_statistics_gangs"
"""The attribute by which a model names the gangs its router statistics are summed over."""


def share_router_statistics(model: nn.Module, gangs: Sequence[Gang]) -> None:
    """Sum the router statistics of `model`'s aux loss over `gangs` (the ranks that hold other
    tokens of the same micro-batch: data and context parallel; see the module docstring)."""
    setattr(model, ROUTER_STATISTICS_GANGS, tuple(g for g in gangs if g.size > 1))


def also_share_router_statistics(model: nn.Module, gang: Any) -> None:
    """Also sum `model`'s router statistics over `gang` (anything with `all_reduce(tensor,
    op)`: the torchft replica groups' live set, whose tokens are other parts of the same
    global micro-batch); a model that names no gangs yet gets this one alone."""
    holder = next((seen for seen in wrapped_chain(model)
                   if hasattr(seen, ROUTER_STATISTICS_GANGS)), model)
    setattr(holder, ROUTER_STATISTICS_GANGS,
            (*getattr(holder, ROUTER_STATISTICS_GANGS, ()), gang))


def _named_gangs(model: nn.Module, checked: tuple[Any, ...]) -> tuple[Any, ...]:
    """The gangs named for `model` now (a replica group's may join after the unit was
    built); `checked` (those found at construction) when none is named."""
    return next((getattr(seen, ROUTER_STATISTICS_GANGS) for seen in wrapped_chain(model)
                 if hasattr(seen, ROUTER_STATISTICS_GANGS)), checked)


def router_statistics_gangs(model: nn.Module, what: str, fix: str) -> tuple[Gang, ...]:
    """The gangs `share_router_statistics` named for `model` (or a model a wrapper holds);
    () in one process. Several ranks and none named: refused (`what` is refused, `fix` says
    how to name them), never a loss computed per rank silently."""
    gangs = next((getattr(seen, ROUTER_STATISTICS_GANGS) for seen in wrapped_chain(model)
                  if hasattr(seen, ROUTER_STATISTICS_GANGS)), None)
    if gangs is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{what} and it runs on several ranks without knowing which hold other "
                f"tokens: {fix} with "
                "units.router_aux_loss.share_router_statistics(model, [gangs.dp, gangs.cp])")
        gangs = ()
    return gangs


def summed_over_gangs(statistics: Tensor, gangs: Sequence[Gang]) -> Tensor:
    """`statistics` (a flat tensor, not differentiable) summed over `gangs`, in place: the
    one small all-reduce per micro-batch (per gang) that makes the aux loss global."""
    for gang in gangs:
        gang.all_reduce(statistics, ReduceOperation.SUM)
    return statistics


class RouterAuxLoss:
    """Keeps the router logits and attention mask of `model`'s last forward (a forward hook)
    and gives its share of the summed loss (see the module docstring)."""

    def __init__(self, model: nn.Module, weight: float, num_experts: int, top_k: int,
                 gangs: Sequence[Gang]) -> None:
        self.weight, self.num_experts, self.top_k = weight, num_experts, top_k
        self._model, self._gangs = model, tuple(gangs)
        self._last: tuple[tuple[Tensor, ...], Tensor | None, Any] | None = None
        self._checked = False
        model.register_forward_hook(self._keep, with_kwargs=True)

    @classmethod
    def of(cls, model: nn.Module) -> RouterAuxLoss | None:
        """The aux loss of `model` (or the model a DDP wrapper holds) when its config asks
        for it; None otherwise (no MoE, `output_router_logits` false, or a weight of 0)."""
        config = getattr(getattr(model, "module", model), "config", None)
        weight = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
        if not getattr(config, "output_router_logits", False) or weight == 0.0:
            return None
        kind = type(getattr(model, "module", model)).__name__
        num_experts = getattr(config, "num_experts", None) or getattr(
            config, "num_local_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if not num_experts or not top_k:
            raise ValueError(f"{kind}: its config asks for the router aux loss "
                             "(output_router_logits) but names no num_experts and "
                             "num_experts_per_tok; set output_router_logits false")
        gangs = router_statistics_gangs(
            model, f"{kind}: its config asks for the router aux loss (output_router_logits)",
            "load it with gangtrain.models.hf.load_pretrained, or name them")
        return cls(model, float(weight), int(num_experts), int(top_k), gangs)

    @property
    def gangs(self) -> tuple[Any, ...]:
        return _named_gangs(self._model, self._gangs)

    def _keep(self, _: nn.Module, __: Any, kwargs: dict[str, Any], output: Any) -> None:
        self._last = (getattr(output, "router_logits", None), kwargs.get("attention_mask"),
                      getattr(output, "aux_loss", None))

    def summed(self, num_targets: Tensor) -> Tensor:
        """`weight * aux_loss * num_targets` of the last forward's global micro-batch, this
        rank's share (see the module docstring). Every rank of the gangs must call it."""
        if self._last is None or not self._last[0]:
            raise RuntimeError("the model's config asks for the router aux loss "
                               "(output_router_logits), but its output has no router_logits")
        (router_logits, mask, own), self._last = self._last, None
        counts, probs, rows = self._statistics(router_logits, mask)
        if not self._checked:
            self._check(counts, probs, rows, own)
        shared = summed_over_gangs(torch.cat(
            [counts, rows.reshape(1), num_targets.detach().reshape(1).float()]), self.gangs)
        counts, rows, targets = shared[:-2], shared[-2], shared[-1]
        aux_share = self.num_experts * (counts / rows * probs / rows).sum()
        return self.weight * aux_share * targets

    def _statistics(self, router_logits: Sequence[Tensor], mask: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens routed to each expert, router probabilities summed per expert, counted
        tokens x layers) over this rank's tokens, padding left out, as transformers counts."""
        device = router_logits[0].device
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        keep = None if mask is None else mask.reshape(-1).to(device, torch.float32)
        for layer_logits in router_logits:
            weights = torch.softmax(layer_logits, dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.detach()
            token = torch.ones(len(weights), device=device) if keep is None else keep
            counts = counts.scatter_add(0, chosen.reshape(-1), token.repeat_interleave(self.top_k))
            probs = probs + (weights.float() * token.unsqueeze(-1)).sum(dim=0)
            rows = rows + token.sum()
        return counts, probs, rows

    def _check(self, counts: Tensor, probs: Tensor, rows: Tensor, own: Tensor | None) -> None:
        """This rank's aux loss by the formula against the model's own (once)."""
        self._checked = True
        mine = (self.num_experts * (counts / rows * probs / rows).sum()).item()
        theirs = float(own.detach()) if own is not None else float("nan")
        # The same float32 sums in the same order: equal to rounding.
        if not abs(mine - theirs) <= 1e-5 * abs(theirs):
            raise ValueError(
                f"the model's router aux loss ({theirs:.6g}) is not transformers' "
                f"load_balancing_loss_func ({mine:.6g}), which gangtrain sums over "
                "data-parallel ranks: train it with output_router_logits false")


class ExpertLayersAuxLoss:
    """The same rule for `layers.moe.MoEFeedForward` layers (the LM recipe's MoE): each
    layer's Switch loss (`layers.moe.load_balancing_loss`, per layer, summed over the layers)
    of the global micro-batch, its counts and token counts summed over the gangs
    `share_router_statistics` named (the recipe's model build names `gangs.dp` and
    `gangs.cp`), each rank adding `weight * targets * sum_layers loss(global counts, its own
    probabilities)`: the ranks' shares sum to one process's loss and gradient."""

    def __init__(self, model: nn.Module, layers: Sequence[MoEFeedForward], weight: float) -> None:
        self.layers, self.weight, self._model = tuple(layers), weight, model
        self._gangs = router_statistics_gangs(
            model, f"{type(unwrapped(model)).__name__}: its MoE layers' load-balancing loss "
            "(moe_aux_loss_weight > 0)", "build it with recipes.lm.recipe.build_model, or name them")

    def summed(self, num_targets: Tensor) -> Tensor:
        """`weight * aux_loss * num_targets` of the last forward's global micro-batch, this
        rank's share. Every rank of the gangs must call it."""
        stats = [layer.balance_statistics for layer in self.layers]
        if any(s is None for s in stats):
            raise RuntimeError("the model's MoE layers have run no forward")
        shared = summed_over_gangs(torch.cat(
            [torch.stack([s.counts for s in stats]).flatten(),
             torch.stack([s.num_tokens for s in stats]),
             num_targets.detach().reshape(1).float()]), self.gangs)
        counts = shared[: -len(stats) - 1].view(len(stats), -1)
        tokens, targets = shared[-len(stats) - 1: -1], shared[-1]
        aux = sum(load_balancing_loss(c, s.prob_sums, n, layer.top_k)
                  for c, s, n, layer in zip(counts, stats, tokens, self.layers))
        return self.weight * aux * targets

    @property
    def gangs(self) -> tuple[Any, ...]:
        return _named_gangs(self._model, self._gangs)
