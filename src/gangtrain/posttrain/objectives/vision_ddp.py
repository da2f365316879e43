"""DDP for a vision-language model trained with its vision tower: transformers' forward
leaves some of the tower's parameters without a gradient (LLaVA's CLIP `post_layernorm`,
which only the pooled output it does not use goes through), and DDP, told nothing, stops at
the next step ("Expected to have finished reduction in the prior iteration"). The SFT,
preference and GRPO objectives load such a policy with `find_unused_parameters=True`. (The
dummy image pass, `models.hf.dummy_image`, does not make it unnecessary: it touches exactly
the parameters a real image does, and those are not all of the tower's.)"""

from __future__ import annotations

from typing import Any

from torch import nn

from gangtrain.models.hf import hf_model_of
from gangtrain.models.hf.dummy_image import run_tower_without_images
from gangtrain.models.hf.vision import is_vlm

__all__ = ["policy_options", "tower_in_every_forward"]


def policy_options(config: Any, hf_config: Any) -> dict[str, Any]:
    """`load_pretrained`'s options for the policy: DDP looks for unused parameters when the
    model is a VLM and the run's data parallelism is DDP."""
    if is_vlm(hf_config) and config.trainer.data_parallel == "ddp":
        return {"find_unused_parameters": True}
    return {}


def tower_in_every_forward(model: nn.Module, processor: Any) -> nn.Module:
    """`model` (a VLM, wrapped or not; `processor` None: a text model, left alone) running
    its tower on a dummy image in a forward without images (`models.hf.dummy_image`): under
    data parallelism every rank's graph holds the tower, a rank whose micro-batch has no
    image too, and the tower's gradient on a step without images is 0 in every layout."""
    hf_model = hf_model_of(model)
    if processor is not None and hf_model is not None:
        run_tower_without_images(hf_model, processor)
    return model
