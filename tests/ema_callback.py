"""An exponential moving average of the weights, as a user writes it: a callback with its
own state (named by tests as ``ema_callback:WeightEMA``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainer.observe.callbacks import Callback


class WeightEMA(Callback):
    """`shadow` follows each parameter (this rank's shard under FSDP2) after every step."""

    def __init__(self, decay: float = 0.75) -> None:
        self.decay = decay
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {}

    def on_after_optimizer_step(self, trainer) -> None:
        with torch.no_grad():
            for name, param in trainer.unit.model.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if name not in self.shadow:
                    self.shadow[name] = local.detach().clone()
                else:
                    self.shadow[name].mul_(self.decay).add_(local, alpha=1 - self.decay)
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates,
                "shadow": {k: v.cpu() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = state["num_updates"]
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
