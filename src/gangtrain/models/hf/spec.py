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

Tensor parallelism follows the model's own declared plan (`config.base_model_tp_plan`, the
head's `_tp_plan`; `models.hf.tensor_parallel`), the experts of MoE families split over EP
(`models.hf.experts`). Layout refusals: the rules every family shares
(`parallel.layout_rules`), with the values of the model's config.json.

A family needs a file of its own only where transformers does not declare what is needed (no
`base_model_tp_plan`, no `base_model_pp_plan`, projections LoRA should adapt under other
names, a forward that must be told its local head count): one module under
`gangtrain.models.hf.families` with an `HFSpec` subclass and `SPECS = {model_type: class}`,
found by `spec_for` (nothing else to edit). Without one, `pipeline_stage` and
`tensor_parallel` refuse by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from gangs import Gangs
from gangs.errors import UserError
from gangtrain.layers.wrappers import WHOLE_MODEL
from gangtrain.models.hf.attention import register_hf_attention
from gangtrain.models.hf.experts import apply_expert_parallel
from gangtrain.models.hf.tensor_parallel import apply_tp_plan, tp_plan_of
from gangtrain.parallel.layout_rules import (
    check_context_split,
    check_pipeline_schedule,
    refuse_tied_under_pipeline,
)
from gangtrain.parallel.pipeline_stages import refuse_tied
from gangtrain.parallel.spec import LayoutSizes
from units.router_aux_loss import share_router_statistics

__all__ = ["FAMILY_SPECS", "HF_LORA_TARGETS", "HFSpec", "PipelineLayout", "spec_for"]

HF_LORA_TARGETS = ("q_proj", "v_proj")
"""The layers LoRA adapts by default in a transformers decoder (peft's default for them)."""


class PipelineLayout:
    """The names, in the base model, of what a pipeline cuts (`config.base_model_pp_plan`):
    `embedding` (first stage), `layers` (the decoder layers), `norm` (last stage)."""

    def __init__(self, model: nn.Module, family: str,
                 plan: dict[str, Any] | None = None) -> None:
        plan = dict(plan or getattr(model.config, "base_model_pp_plan", None) or {})
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
    """The spec of a transformers causal LM (see the module docstring). A family's own file
    overrides `tp_plan`, `pp_plan`, `lora_targets` or `tensor_parallel` where transformers
    declares nothing."""

    lora_targets: tuple[str, ...] = HF_LORA_TARGETS

    def __init__(self, model_type: str) -> None:
        self.name = f"hf:{model_type}"

    # -- what transformers declares, unless the family's file says otherwise ---------------
    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        """`{module pattern: style name}` (`models.hf.tensor_parallel.STYLES`)."""
        return tp_plan_of(model)

    def pp_plan(self, model: nn.Module) -> dict[str, Any] | None:
        """The base model's pipeline layout, as `config.base_model_pp_plan` writes it."""
        return getattr(model.config, "base_model_pp_plan", None)

    # -- the ModelSpec ------------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return getattr(_base(model), self._layout(model).layers)

    def pipeline_stage(self, model: nn.Module, layers: range, first: bool,
                       last: bool) -> nn.Module:
        layout = self._layout(model)
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

    def tensor_parallel(self, model: nn.Module, gangs: Gangs) -> None:
        """The experts split over `gangs.ep` (`models.hf.experts`), and the TP plan over
        `gangs.tp`, when there is more than one rank to split over; the router's aux loss
        statistics summed over the ranks that hold other tokens (`units.router_aux_loss`)."""
        apply_expert_parallel(model, gangs.ep)
        share_router_statistics(model, (gangs.dp, gangs.cp))
        if gangs.tp.size == 1:
            return
        if gangs.mesh is None:
            raise UserError("tensor parallelism needs the gangs' device mesh (setup_gangs)")
        apply_tp_plan(model, gangs.mesh["tp"], self.tp_plan(model))

    def check_layout(self, config: Any, sizes: LayoutSizes) -> None:
        """`config`: the model's `PretrainedConfig` (its config.json)."""
        check_pipeline_schedule(sizes)
        check_context_split(sizes, int(getattr(config, "num_attention_heads", 0) or 0))
        refuse_tied_under_pipeline(sizes, bool(getattr(config, "tie_word_embeddings", False)),
                                   model_file="tie_word_embeddings in config.json")

    def model_files(self, tokenizer: Any = None) -> Any:
        """`tokenizer`: as the run used it, kept in each `step_N/hf/` (see `HFModelFiles`)."""
        from gangtrain.models.hf.trainer_files import HFModelFiles

        return HFModelFiles(tokenizer)

    def _layout(self, model: nn.Module) -> PipelineLayout:
        return PipelineLayout(model, self.name, self.pp_plan(model))


FAMILY_SPECS: dict[str, Callable[[str], HFSpec]] = {}
"""A family's own spec by `model_type`, registered in code (a program's own family); the files
under `gangtrain.models.hf.families` are found without an entry here."""


@cache
def family_files() -> dict[str, Callable[[str], HFSpec]]:
    """`{model_type: spec class}` of every module of `gangtrain.models.hf.families` (its
    `SPECS`), imported on first use."""
    from gangtrain.models.hf import families

    found: dict[str, Callable[[str], HFSpec]] = {}
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        found.update(getattr(module, "SPECS", {}))
    return found


def spec_for(model: Any) -> HFSpec:
    """The spec of transformers model `model` (or of its `PretrainedConfig`, before a model
    is built): its family's own (`FAMILY_SPECS`, `gangtrain.models.hf.families`) or the
    generic one, read from its config and class."""
    config = getattr(model, "config", model)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    make = FAMILY_SPECS.get(model_type) or family_files().get(model_type, HFSpec)
    return make(model_type)


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
