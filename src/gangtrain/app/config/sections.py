"""Config sections the recipes share: `Section` (the base of every section: unknown keys are
an error, attribute docstrings are the fields' descriptions), the learning-rate schedule's
`LRSchedulerSection`, the one `GangsSection` (every layout: `check` refuses by name what
does not combine) and the `LoraSection` of the recipes that load Hugging Face models."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from gangs.fault_tolerance import FaultToleranceSettings
from gangtrain.layers.lora import LoraSettings
from gangtrain.parallel.plan import check_hsdp
from trainer.errors import UserError

__all__ = ["GangsSection", "LRSchedulerSection", "LoraSection", "Section"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LRSchedulerSection(Section):  # trainer.lr_schedules.warmup_cosine's settings
    warmup_steps: int = Field(default=100, ge=0)
    final_lr_scale: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay from lr to lr * final_lr_scale at num_steps, then constant."""
    num_steps: PositiveInt | None = None
    """Length of the schedule in steps. null: the first run's trainer.max_num_steps, kept
    in the checkpoint, so extending a run (a larger max_num_steps on resume) leaves the
    learning rates of the steps already taken as they were."""


PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble",
                               "zbv_zero_bubble"]


class GangsSection(Section):
    tp_size: PositiveInt = 1
    ep_size: PositiveInt = 1
    dp_shard_size: PositiveInt | None = None
    """HSDP: FSDP2 shards over groups of this many DP ranks (one node) and replicates across
    them; needs trainer.data_parallel=fsdp. null: shard over every DP rank."""
    pp_size: PositiveInt = 1
    """Pipeline parallelism: the model's layers cut into stages over this many ranks (the
    outermost axis: stages may sit on different nodes); trainer.num_accumulate micro-batches
    a step are the schedule's. With DP (DDP, FSDP2: each stage sharded) and TP; untied
    embeddings."""
    pp_schedule: PipelineScheduleName = "1f1b"
    """gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble (2 stages a rank) or
    zbv_zero_bubble (2 stages a rank, in a V)."""
    pp_boundaries: list[PositiveInt] | None = None
    """The index of the first layer of each stage after the first (null: as even as
    possible), e.g. [3] cuts 8 layers into 0-2 and 3-7."""
    cp_size: PositiveInt = 1
    """Context parallelism: every sequence split over this many ranks, attention exact
    across them (Ulysses all-to-all over heads: num_heads / tp_size divisible by cp_size,
    seq_len too). With DP (DDP, FSDP2) and TP; not with pp_size > 1."""
    timeout_s: PositiveInt = 600
    fault_tolerance: FaultToleranceSettings | None = None
    """torchft replica groups (trainer.fault_tolerance): {replica_groups, replica_id,
    lighthouse, min_replicas}; each group a job of its own that trains on when another
    fails. null: off."""

    @model_validator(mode="after")
    def _pipeline_settings_need_a_pipeline(self) -> GangsSection:
        """A pipeline's settings without a pipeline would be ignored: refused by name."""
        if self.pp_size == 1:
            for name, value, default in (("pp_schedule", self.pp_schedule, "1f1b"),
                                         ("pp_boundaries", self.pp_boundaries, None)):
                if value != default:
                    raise ValueError(f"gangs.{name} ({value!r}) is only used with "
                                     "gangs.pp_size > 1: set gangs.pp_size, or leave it out")
        return self

    def check(self, data_parallel: str | None) -> None:
        """A `UserError` naming the setting when these sizes do not combine with the
        trainer's `data_parallel` or with each other (before any process group exists)."""
        try:
            check_hsdp(data_parallel, self.dp_shard_size)  # the build plan's own rule
        except ValueError:
            raise UserError("config 'gangs.dp_shard_size' (HSDP) needs "
                            "trainer.data_parallel=fsdp") from None
        if self.pp_size > 1 and self.cp_size > 1:
            raise UserError(
                f"config 'gangs.cp_size' {self.cp_size} with gangs.pp_size {self.pp_size}: "
                "context parallelism inside pipeline stages is not supported yet; use one")


class LoraSection(Section):
    """LoRA adapters on the frozen pretrained model (`layers.lora`, peft's meaning and
    defaults): on when `r` is set, e.g. `--set lora.r=16`."""

    r: PositiveInt | None = None
    """Rank of each adapter; null: full fine-tuning (no adapters)."""
    alpha: float = Field(default=8.0, gt=0)
    """The update is scaled by alpha / r (peft's lora_alpha)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input (peft's lora_dropout); 0 under tensor parallelism."""
    target_modules: list[str] | None = None
    """Linear layers to adapt, by name or name suffix (peft's rule); null: the model family's
    own (its spec's `lora_targets`: the query and value projections of the Hugging Face
    decoders, `models.hf.spec.HF_LORA_TARGETS`)."""
    base_dtype: Literal["fp32", "bf16"] = "fp32"
    """The frozen base's parameters: bf16 halves their memory (the merged export adds the
    adapters to the base files' own weights); the adapters, their gradients and AdamW's
    moments stay float32."""

    RESUME_GUARD: ClassVar[tuple[str, ...]] = ("lora.r", "lora.alpha", "lora.target_modules")

    @model_validator(mode="after")
    def _adapter_settings_need_adapters(self) -> LoraSection:
        """An adapter's setting without adapters (r null) would be ignored: refused by name."""
        if self.r is None:
            for name, field in type(self).model_fields.items():
                if name != "r" and getattr(self, name) != field.get_default(
                        call_default_factory=True):
                    raise ValueError(f"lora.{name} is set but lora.r is null (no adapters): "
                                     "set lora.r to train adapters, or leave it out")
        return self
    """The settings a resumed run may not change (the adapters' shapes and meaning)."""

    def settings(self) -> LoraSettings | None:
        """The adapters' settings; None without adapters (`r` null)."""
        if self.r is None:
            return None
        try:
            return LoraSettings(self.r, self.alpha, self.dropout,
                                None if self.target_modules is None
                                else tuple(self.target_modules))
        except ValueError as error:
            raise UserError(f"config {error}") from None

    def load_options(self, seed: int | None) -> dict[str, Any]:
        """`load_pretrained`'s keywords for these adapters (none without), their
        initialisation seeded by the run's `seed`."""
        settings = self.settings()
        if settings is None:
            return {}
        dtype = torch.bfloat16 if self.base_dtype == "bf16" else None
        return {"lora": settings, "seed": seed or 0, "dtype": dtype}
