"""The `ModelSpec` of a Hugging Face decoder model (`spec_for(model)`), read from its own
config and class: nothing here re-implements a family.

Pipeline stages run THE MODEL'S OWN forward. transformers declares how a base model is laid
out for a pipeline (`config.base_model_pp_plan`: the token embedding first, the decoder
layers, the final norm last); a stage holds the embedding (first stage), its run of decoder
layers and the final norm and output head (last stage), and its forward calls the whole
model's own `forward` with the layers it does not hold passed over: before its run they hand
on the stage's input, after it they hand on what they receive. So the masks the model builds
(causal, sliding window per `layer_types`), its rotary tables, embedding scaling, final norm
and logit soft-capping are the model's own on every stage. A stage other than the first
gives the model its input as `inputs_embeds` only for the shape the masks are built from.

Context parallelism: the model's attention modules run as they are, with transformers'
attention kernel replaced through its attention interface (`models.hf.attention`), which
keeps each layer's window, soft-capping and scaling.

A family needs its own entry only when its layout is not declared this way (no
`base_model_pp_plan`): `pipeline_stage` then refuses by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from gangtrain.layers.wrappers import WHOLE_MODEL
from gangtrain.models.hf.attention import register_hf_attention
from gangtrain.parallel.pipeline_stages import refuse_tied

__all__ = ["FAMILY_SPECS", "HF_LORA_TARGETS", "HFSpec", "PipelineLayout", "spec_for"]

HF_LORA_TARGETS = ("q_proj", "v_proj")
"""The layers LoRA adapts by default in a transformers decoder (peft's default for them)."""


class PipelineLayout:
    """The names, in the base model, of what a pipeline cuts (`config.base_model_pp_plan`):
    `embedding` (first stage), `layers` (the decoder layers), `norm` (last stage)."""

    def __init__(self, model: nn.Module, family: str) -> None:
        plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
        base = _base(model)
        layers = [name for name in plan if isinstance(getattr(base, name, None), nn.ModuleList)]
        if not plan or len(layers) != 1:
            raise ValueError(
                f"pipeline parallelism: {family} ({type(model).__name__}) declares no pipeline "
                "layout (its config's base_model_pp_plan names no decoder layer list); train "
                "it with gangs.pp_size 1")
        names = list(plan)
        self.embedding, self.layers, self.norm = names[0], layers[0], names[-1]
        if self.embedding == self.layers or self.norm == self.layers:
            raise ValueError(f"pipeline parallelism: {family}'s base_model_pp_plan {names} "
                             "has no embedding before or norm after its layers")


class HFSpec:
    """The spec of a transformers causal LM (see the module docstring)."""

    lora_targets = HF_LORA_TARGETS

    def __init__(self, model_type: str) -> None:
        self.name = f"hf:{model_type}"

    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return getattr(_base(model), PipelineLayout(model, self.name).layers)

    def pipeline_stage(self, model: nn.Module, layers: range, first: bool,
                       last: bool) -> nn.Module:
        layout = PipelineLayout(model, self.name)
        refuse_tied(getattr(_base(model), layout.embedding), model.get_output_embeddings())
        if getattr(model.config, "output_router_logits", False):
            # The last stage's forward sees only its own routers, and the loss its logits.
            raise ValueError(
                f"pipeline parallelism: {self.name}'s config asks for the router's auxiliary "
                "loss (output_router_logits), which a pipeline stage cannot compute over "
                "every layer's router; set output_router_logits false in config.json, or "
                "gangs.pp_size 1")
        return DecoderStage(model, layout, layers, first, last)

    def attend_over(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        register_hf_attention(model, group)


FAMILY_SPECS: dict[str, Callable[[str], HFSpec]] = {}
"""A family's own spec by `model_type`, only where the generic one does not fit (a subclass
of `HFSpec` in the family's own file under `models/`, registered here)."""


def spec_for(model: nn.Module) -> HFSpec:
    """The spec of transformers model `model`: its family's own (`FAMILY_SPECS`) or the
    generic one, read from its config and class."""
    model_type = str(getattr(model.config, "model_type", type(model).__name__))
    return FAMILY_SPECS.get(model_type, HFSpec)(model_type)


def _base(model: nn.Module) -> Any:
    return getattr(model, model.base_model_prefix)


class DecoderStage(nn.Module):
    """Decoder layers `layers` of a HF causal LM run by the model's own forward (see the
    module docstring). It holds, under their names in the whole model, the base model's
    modules a stage runs (rotary tables and the like), its own layers, the embedding when
    `first` and the final norm and output head when `last`; the whole model is kept aside
    as its `whole_model` (`layers.wrappers`), not as a submodule, so its other (meta)
    parameters are not this stage's.

    forward(h, position_ids): `h` the input ids (first stage) or the previous stage's hidden
    states; returns the logits (last stage) or (hidden states, position_ids)."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, layers: range, first: bool,
                 last: bool) -> None:
        super().__init__()
        base = _base(model)
        self.first, self.last, self.layout, self.span = first, last, layout, layers
        self.__dict__[WHOLE_MODEL] = model  # not registered: the other stages' parameters
        kept = nn.Module()
        for name, child in base.named_children():
            if name == layout.layers:
                kept.add_module(name, nn.ModuleDict(
                    {str(i): getattr(base, name)[i] for i in layers}))
            elif (name != layout.embedding or first) and (name != layout.norm or last):
                kept.add_module(name, child)
        self.add_module(model.base_model_prefix, kept)
        if last:
            head_name = next(n for n, m in model.named_children()
                             if m is model.get_output_embeddings())
            self.add_module(head_name, model.get_output_embeddings())

    def initialize_weights(self) -> None:
        """The model's own initialisation, which computes what no checkpoint holds (rotary
        tables); what was loaded carries transformers' flag and is left alone, and the
        other stages' tensors are on the meta device, where it writes nothing."""
        self.__dict__[WHOLE_MODEL].initialize_weights()

    def forward(self, h: Tensor, position_ids: Tensor) -> Any:
        model: nn.Module = self.__dict__[WHOLE_MODEL]
        base = _base(model)
        layout = self.layout
        all_layers = getattr(base, layout.layers)
        norm = getattr(base, layout.norm)
        view = [layer if i in self.span else
                (_HandOn(h) if i < self.span.start else _PassOn())
                for i, layer in enumerate(all_layers)]
        inputs = {"input_ids": h} if self.first else {"inputs_embeds": h.detach()}
        try:
            setattr(base, layout.layers, nn.ModuleList(view))
            if not self.last:  # the final norm is the last stage's
                setattr(base, layout.norm, nn.Identity())
            runner = model if self.last else base
            output = runner(**inputs, position_ids=position_ids, use_cache=False)
        finally:
            setattr(base, layout.layers, all_layers)
            setattr(base, layout.norm, norm)
        if self.last:
            return output.logits
        return output.last_hidden_state, position_ids.contiguous()  # sent as laid out


class _HandOn(nn.Module):
    """A layer before the stage's run: the stage's input, whatever it is given."""

    def __init__(self, h: Tensor) -> None:
        super().__init__()
        self.h = h

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.h


class _PassOn(nn.Module):
    """A layer after the stage's run: what it is given."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states
