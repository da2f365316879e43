"""DDP for a vision-language model trained with its vision tower: transformers' forward
leaves some of the tower's parameters without a gradient (LLaVA's CLIP `post_layernorm`,
which only the pooled output it does not use goes through), and DDP, told nothing, stops at
the next step ("Expected to have finished reduction in the prior iteration"). The
preference and GRPO objectives load such a policy with `find_unused_parameters=True`."""

from __future__ import annotations

from typing import Any

from gangtrain.models.hf.vision import is_vlm

__all__ = ["policy_options"]


def policy_options(config: Any, hf_config: Any) -> dict[str, Any]:
    """`load_pretrained`'s options for the policy: DDP looks for unused parameters when the
    model is a VLM and the run's data parallelism is DDP."""
    if is_vlm(hf_config) and config.trainer.data_parallel == "ddp":
        return {"find_unused_parameters": True}
    return {}
