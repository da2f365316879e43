"""`load_layout`: a pretrained Hugging Face causal LM under any layout of the gangs, with
the units that train and validate it: what `recipes.sft` and `recipes.finetune` share.

    layout = load_layout(path, gangs, data_parallel="fsdp", num_accumulate=4)
    optimizer = build(layout.model)
    Trainer(layout.train_unit(), ..., valid_units=[layout.valid_unit()])

- ``gangs.pp.size > 1``: the model is cut into pipeline stages by the one build plan
  (`parallel.plan.build_model(pipeline=...)`) as its family's spec says
  (`models.hf.spec_for`: the model's own forward on every stage), the units are the
  pipeline's (`units.pipeline`);
- ``gangs.cp.size > 1``: every attention of the model attends over the cp gang through
  transformers' attention interface (window, soft-capping and scaling kept);
- TP, FSDP2/HSDP and DDP as `load_pretrained` applies them; under PP, FSDP2/HSDP shard
  each stage, and "ddp" leaves the stages unwrapped (the pipeline step sums their
  gradients over DP).

What cannot be exact is refused by name before any model is built: the layout's own rules
(`gangtrain.app.config.sections.GangsSection.check`), then the model's, by its family's spec
(`spec_for(hf_config).check_layout`; both in `gangtrain.app.pretrained.check_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gangs import Gangs
from gangtrain.models.hf.load import load_pretrained
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.models.hf.spec import DecoderStage, HFSpec, spec_for
from gangtrain.parallel.pipeline import PipelinedModel, pipeline_model
from trainer.errors import UserError
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.pipeline import PipelineLMEvalUnit, PipelineLMUnit, summed_lm_loss

__all__ = ["HFLayout", "load_layout"]


@dataclass
class HFLayout:
    """The loaded model as this rank holds it."""

    model: nn.Module  # what the optimizer and checkpoints see (this rank's stages under PP)
    pipeline: PipelinedModel | None

    def train_unit(self, **options: Any) -> Any:
        """The training unit (`options`: `CausalLMUnit`'s, e.g. `flops_per_target`)."""
        if self.pipeline is not None:
            return PipelineLMUnit(self.pipeline)
        return CausalLMUnit(self.model, **options)

    def valid_unit(self, **options: Any) -> Any:
        """The validation unit (`options`: `CausalLMEvalUnit`'s, e.g. `token_accuracy`;
        a pipeline's reports loss and perplexity)."""
        if self.pipeline is not None:
            return PipelineLMEvalUnit(self.pipeline)
        return CausalLMEvalUnit(self.model, **options)


def load_layout(path: str, gangs: Gangs, *, data_parallel: str | None, num_accumulate: int,
                pp_schedule: str = "1f1b", pp_boundaries: list[int] | None = None,
                spec: HFSpec | None = None, **load_options: Any) -> HFLayout:
    """The pretrained model of `path` over `gangs` (see the module docstring);
    `num_accumulate`: the micro-batches of a step (a pipeline schedule's); `load_options`:
    `load_pretrained`'s (adapters, activation checkpointing, ...); `spec`: the family's,
    when the caller has looked it up (else looked up here)."""
    if gangs.pp.size > 1:
        def split(model: nn.Module) -> PipelinedModel:
            return pipeline_model(
                model, gangs.pp.as_process_group(), spec=spec or spec_for(model),
                loss_fn=summed_lm_loss, num_microbatches=num_accumulate,
                schedule=pp_schedule, boundaries=pp_boundaries,
                device=gangs.device)

        try:
            pipe = load_pretrained(path, gangs, data_parallel=data_parallel, pipeline=split,
                                   spec=spec, **load_options)
        except ValueError as error:  # a schedule, boundaries or options the split refuses
            raise UserError(f"config 'gangs': {error}") from None
        # What no checkpoint holds (rotary tables) is computed by the model's own init: the
        # loader reaches one stage's, not those of a rank holding several (interleaved).
        for stage in pipe.stages:
            if isinstance(stage.submod, DecoderStage):
                stage.submod.initialize_weights()
        return HFLayout(pipe.model, pipe)
    model = load_pretrained(path, gangs, data_parallel=data_parallel, spec=spec,
                            **load_options)
    if gangs.cp.size > 1:
        hf_model = hf_model_of(model)
        assert hf_model is not None  # load_pretrained builds a transformers model
        try:
            (spec or spec_for(hf_model)).attend_over(hf_model, gangs.cp.as_process_group())
        except ValueError as error:
            raise UserError(f"config 'gangs.cp_size': {error}") from None
    return HFLayout(model, None)
