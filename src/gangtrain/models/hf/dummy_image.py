"""A micro-batch without images: the vision tower and projector run on a dummy image and add
`0 * sum(outputs)` to the language model's input embeddings.

Why: with data parallelism every rank must run the same modules at every step. A rank whose
micro-batch holds no image would skip the tower: DDP's reducer then waits for gradients the
tower's parameters never get (an error at the next step), FSDP2's all-gathers and
reduce-scatters of the tower's blocks are met by one rank only (a hang). The dummy pass
(the common fix, e.g. VeOmni's and LLaMA-Factory's) runs the tower where the model would:
inside the base model's forward, before the language model, so every rank issues the same
collectives in the same order, forward and backward.

Exact: the dummy's outputs enter as `0 * sum`, so the embeddings, the loss and every
gradient are unchanged (x + 0 = x for finite x), and the tower's and projector's parameters
get zero gradients. Installed in every layout, one process too: on a step whose batch holds
no image at all the tower's gradient is then 0, not None, everywhere, so the optimizer steps
the tower alike (AdamW moves a parameter with a zero gradient by its moments and weight
decay, and skips one without a gradient). The dummy image is what the run's processor makes
of one grey 28 x 28 image, through the family's own `get_image_features` (tower and
projector), of whose output only what the forward uses enters the sum, so it touches
exactly the parameters a real image does. Every forward without
pixels runs it, a decoding step's too (were some ranks to run the tower and others not,
FSDP2 would hang).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from gangtrain.data.vision import TOKEN_KEYS

__all__ = ["dummy_image_inputs", "run_tower_without_images"]


def dummy_image_inputs(model: nn.Module, processor: Any) -> dict[str, Tensor]:
    """The keyword arguments of the base model's `get_image_features` for one grey image, as
    the processor lays them out in a batch."""
    from PIL import Image

    placeholder = getattr(processor, "boi_token", None) or processor.image_token
    out = processor(text=[placeholder], images=[[Image.new("RGB", (28, 28), (128,) * 3)]],
                    return_tensors="pt", add_special_tokens=False)
    base = getattr(model, model.base_model_prefix)
    accepted = inspect.signature(base.get_image_features).parameters
    return {k: v for k, v in out.items() if k not in TOKEN_KEYS and k in accepted}


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):  # transformers' ModelOutput is one
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _used(features: Any) -> Any:
    """What the model's forward takes of `get_image_features`' output: its `pooler_output`
    (the projected features, in every family tried). Not the rest: LLaVA's hidden states
    hold the tower's last layer, which LLaVA-1.5 (`vision_feature_layer=-2`) never uses."""
    pooled = getattr(features, "pooler_output", None)
    return features if pooled is None else pooled


def run_tower_without_images(model: nn.Module, processor: Any) -> None:
    """Every forward of `model` (a transformers VLM) called without `pixel_values` runs its
    tower and projector on a dummy image and adds `0 * sum(outputs)` to the language model's
    `inputs_embeds` (see the module docstring)."""
    base = getattr(model, model.base_model_prefix)
    decoder = model.get_decoder()
    dummy = dummy_image_inputs(model, processor)
    pending: list[Tensor] = []

    def before_base(module, args, kwargs):  # noqa: ANN001, ANN202
        pending.clear()
        if kwargs.get("pixel_values") is None:
            device = next(module.parameters()).device
            features = module.get_image_features(
                **{k: v.to(device) for k, v in dummy.items()}, return_dict=True)
            pending.append(sum(t.sum() for t in _tensors(_used(features))) * 0)

    def before_decoder(module, args, kwargs):  # noqa: ANN001, ANN202
        embeds = kwargs.get("inputs_embeds")
        if not pending or embeds is None:
            return None
        zero = pending.pop()
        kwargs["inputs_embeds"] = embeds + zero.to(embeds.dtype)
        return args, kwargs

    base.register_forward_pre_hook(before_base, with_kwargs=True)
    decoder.register_forward_pre_hook(before_decoder, with_kwargs=True)

