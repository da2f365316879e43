"""The router's auxiliary (load-balancing) loss of a Hugging Face mixture-of-experts model,
added to the trained loss when the model's config asks for it (`output_router_logits`, with
weight `router_aux_loss_coef`), as the model's own `forward(labels=...)` adds it to its mean
loss: the unit sums its loss over targets, so it adds `coef * aux_loss * num_targets`.

The model computes `aux_loss` over the tokens of the batch it is given (its own
`load_balancing_loss_func`): under data parallelism each rank's share is its own batch's,
weighted by its targets, as in transformers' own data-parallel training."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["RouterAuxLoss"]


class RouterAuxLoss:
    """Keeps the `aux_loss` of `model`'s last forward (a forward hook) and gives its share of
    the summed loss."""

    def __init__(self, model: nn.Module, weight: float) -> None:
        self.weight = weight
        self._last: Tensor | None = None
        model.register_forward_hook(self._keep)

    @classmethod
    def of(cls, model: nn.Module) -> RouterAuxLoss | None:
        """The aux loss of `model` (or the model a DDP wrapper holds) when its config asks
        for it; None otherwise (no MoE, `output_router_logits` false, or a weight of 0)."""
        config = getattr(getattr(model, "module", model), "config", None)
        weight = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
        if not getattr(config, "output_router_logits", False) or weight == 0.0:
            return None
        return cls(model, float(weight))

    def _keep(self, _: nn.Module, __: Any, output: Any) -> None:
        self._last = getattr(output, "aux_loss", None)

    def summed(self, num_targets: Tensor) -> Tensor:
        """`weight * aux_loss * num_targets` of the last forward."""
        if self._last is None:
            raise RuntimeError("the model's config asks for the router aux loss "
                               "(output_router_logits), but its output has no aux_loss")
        aux, self._last = self._last, None
        return self.weight * aux * num_targets
