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
(`gangtrain.app.config.sections.GangsSection.check`), then the model's sizes (`check_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gangs import Gangs
from gangtrain.models.hf.load import load_pretrained
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.models.hf.spec import DecoderStage, spec_for
from gangtrain.parallel.pipeline import SPLIT_BACKWARD, PipelinedModel, pipeline_model
from trainer.errors import UserError
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.pipeline import PipelineLMEvalUnit, PipelineLMUnit, summed_lm_loss

__all__ = ["HFLayout", "check_layout", "load_layout"]


def check_layout(hf_config: Any, *, tp_size: int, pp_size: int, cp_size: int,
                 seq_len: int, pp_schedule: str = "1f1b",
                 activation_checkpointing: bool = False) -> None:
    """A `UserError` naming the setting when the model of `hf_config` (its config.json)
    cannot be split by these settings of the config's `gangs` section (the recipes that
    call this validate, which torch's V schedule cannot)."""
    if pp_size > 1 and pp_schedule == "zbv_zero_bubble":
        raise UserError("config 'gangs.pp_schedule' zbv_zero_bubble cannot run the recipe's "
                        "validation (torch's V schedule runs backward actions in a "
                        "forward-only pass): use interleaved_zero_bubble or 1f1b")
    if pp_size > 1 and activation_checkpointing and pp_schedule in SPLIT_BACKWARD:
        raise UserError(f"config 'model.activation_checkpointing' with gangs.pp_schedule "
                        f"{pp_schedule}: a zero-bubble schedule runs each backward as two "
                        "passes, which one recomputation cannot serve; use 1f1b, gpipe or "
                        "interleaved_1f1b, or set it to false")
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    if cp_size > 1:
        if seq_len % cp_size:
            raise UserError(f"config 'data.seq_len' {seq_len} must be a multiple of "
                            f"gangs.cp_size {cp_size}: each rank holds an equal slice")
        if heads % (tp_size * cp_size):
            raise UserError(
                f"config 'gangs.cp_size' {cp_size}: the model's {heads} attention heads "
                f"(split over gangs.tp_size {tp_size} first) are not divisible by it; "
                "each cp rank attends for an equal share of the heads")
    if pp_size > 1 and getattr(hf_config, "tie_word_embeddings", False):
        raise UserError(
            f"config 'gangs.pp_size' {pp_size}: the model ties its output layer to its "
            "input embedding (tie_word_embeddings in config.json), which would live on two "
            "stages; train it with gangs.pp_size 1")


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
                **load_options: Any) -> HFLayout:
    """The pretrained model of `path` over `gangs` (see the module docstring);
    `num_accumulate`: the micro-batches of a step (a pipeline schedule's); `load_options`:
    `load_pretrained`'s (adapters, activation checkpointing, ...)."""
    if gangs.pp.size > 1:
        def split(model: nn.Module) -> PipelinedModel:
            return pipeline_model(
                model, gangs.pp.as_process_group(), spec=spec_for(model),
                loss_fn=summed_lm_loss, num_microbatches=num_accumulate,
                schedule=pp_schedule, boundaries=pp_boundaries,
                device=gangs.device)

        try:
            pipe = load_pretrained(path, gangs, data_parallel=data_parallel, pipeline=split,
                                   **load_options)
        except ValueError as error:  # a schedule, boundaries or options the split refuses
            raise UserError(f"config 'gangs': {error}") from None
        # What no checkpoint holds (rotary tables) is computed by the model's own init: the
        # loader reaches one stage's, not those of a rank holding several (interleaved).
        for stage in pipe.stages:
            if isinstance(stage.submod, DecoderStage):
                stage.submod.initialize_weights()
        return HFLayout(pipe.model, pipe)
    model = load_pretrained(path, gangs, data_parallel=data_parallel, **load_options)
    if gangs.cp.size > 1:
        hf_model = hf_model_of(model)
        assert hf_model is not None  # load_pretrained builds a transformers model
        try:
            spec_for(hf_model).attend_over(hf_model, gangs.cp.as_process_group())
        except ValueError as error:
            raise UserError(f"config 'gangs.cp_size': {error}") from None
    return HFLayout(model, None)
