"""The `recipes.preference` config: the shared lr_scheduler, trainer, gangs and lora
sections, and its own model, optimizer (TRL's DPO defaults), data (pairs) and loss sections. TRL's `DPOConfig` names map to: `beta` -> loss.beta, `loss_type` -> loss.kind,
`label_smoothing`, `rpo_alpha` -> loss.*, `max_length` -> data.seq_len,
`truncation_mode` -> data.over_long (the prompt is cut first)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt

from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig
from trainer.errors import UserError
from units.preference import PreferenceLoss


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json, safetensors weights, tokenizer
    files with a chat template for conversations), usually an SFT result. Required."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (the policy's)."""


class OptimizerSection(AdamWConfig):
    """AdamW with TRL's DPOConfig defaults (lr 1e-6, betas 0.9/0.999, no weight decay)."""

    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class DataSection(Section):
    files: list[str] = []
    """Training pairs: JSONL, JSON or Parquet files, or directories of them. Required."""
    valid_files: list[str] = []
    """Validation pairs, read like `files`; empty: `valid_fraction` of `files` held out."""
    prompt_field: str = "prompt"
    """Absent from a record: the prompt is the beginning `chosen` and `rejected` share."""
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    chat_template: str | None = None
    """A Jinja chat template file replacing the tokenizer's own; null: the tokenizer's."""
    seq_len: PositiveInt = 1024
    """Tokens of a pair's longer side at most (TRL's max_length)."""
    over_long: Literal["truncate", "drop"] = "truncate"
    """A longer pair: cut the prompt from its start (both sides alike), then the ends; or
    leave the pair out. Either is counted in the log."""
    batch_size: PositiveInt = 16
    """The GLOBAL micro-batch in pairs, across DP ranks (each pair is two rows)."""
    valid_batch_size: PositiveInt = 16
    valid_fraction: float = Field(default=0.05, gt=0, lt=1)
    split_seed: int = 0
    shuffle_seed: int = 0
    cache_dir: str | None = None
    """Where `datasets` keeps the Arrow copies and tokenised tables; null: its own."""
    num_workers: PositiveInt | None = None
    """Processes that tokenise (datasets' num_proc); null: this one."""


class LossSection(Section):
    kind: Literal["dpo", "ipo", "simpo", "orpo"] = "dpo"
    """dpo (sigmoid), ipo, simpo (reference-free, length-normalised), orpo (NLL + odds
    ratio, reference-free); see `units.preference`."""
    beta: float = Field(default=0.1, gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Conservative DPO / SimPO: the share of pairs assumed flipped."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    rpo_alpha: float | None = None
    """Weight of an NLL term on the chosen answer (per token, per pair); null: none."""

    def settings(self) -> PreferenceLoss:
        try:
            return PreferenceLoss(self.kind, self.beta, self.label_smoothing,
                                  self.simpo_gamma, self.rpo_alpha)
        except ValueError as error:
            raise UserError(f"config {error}") from None


class PreferenceConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    loss: LossSection = LossSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection(warmup_steps=10)
    trainer: TrainerConfig = FINETUNING_TRAINER
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


# Settings a resumed run may not change: the model, the loss and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.prompt_field", "data.chosen_field",
                "data.rejected_field", "data.chat_template", "data.seq_len", "data.over_long",
                "data.batch_size", "data.valid_fraction", "data.split_seed",
                "data.shuffle_seed", "loss.kind", "loss.beta", *LoraSection.RESUME_GUARD)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "pairs of up to 1024 tokens, global batch 16 pairs, DPO beta 0.1, lr 1e-6, "
                "bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: pairs of up to 128 tokens, 30 "
                "steps, fp32",
        "data": {"seq_len": 128, "batch_size": 4, "valid_batch_size": 8,
                 "valid_fraction": 0.1},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 3},
        "trainer": {"max_num_steps": 30, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 5,
                    "dtype": "fp32", "progress": False},
    },
}
