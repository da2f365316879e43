"""The `recipes.sft` config: sections model, data, optimizer (any `torch.optim` class,
`gangtrain.app.config.optimizers`), lr_scheduler (warm-up and a decay, `trainer.lr_schedules`),
trainer, gangs, lora (adapters, off by default). docs/sft.md maps TRL's `SFTConfig` names
to these."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from gangtrain.app.config.optimizers import OptimizerConfig
from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, TrainerConfig

_Section = Section


class ModelSection(_Section):
    path: str | None = None
    """A local Hugging Face model directory: config.json, safetensors weights, tokenizer
    files (with a chat template for conversations), generation_config.json. Required."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less memory, about a
    third more compute."""
    dtype: Literal["fp32", "bf16"] | None = None
    """The parameters' dtype (TRL's model_init_kwargs dtype): bf16 halves their memory, and
    AdamW then updates bf16 weights (rounding small updates away); null: fp32. Compute
    dtype is trainer.dtype (autocast). With LoRA use lora.base_dtype."""
    attn_implementation: str | None = None
    """transformers' attention kernel (eager, sdpa, flex_attention, ...); null: the model's
    default."""
    neftune_noise_alpha: float | None = Field(default=None, gt=0)
    """NEFTune: uniform noise of alpha / sqrt(length x width) on the input embeddings, in
    training only (HF's formula; length is the packed row's); null: off."""


class DataSection(_Section):
    files: list[str] = []
    """Training data: JSONL, JSON or Parquet files, or directories of them (shards). Each
    entry is one dataset (see `weights`). Required."""
    valid_files: list[str] = []
    """Validation data, read like `files`; empty: `valid_fraction` of `files` held out."""
    weights: list[float] | None = None
    """Mixing weights, one per entry of `files`: each dataset contributes its weight's share
    of the examples (repeated or cut to it). null: every example once."""
    format: Literal["text", "prompt_completion", "chat"] | None = None
    """null: detected from the records' fields (`messages`: chat; `prompt` and `completion`:
    prompt_completion; `text`: text)."""
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chat_template: str | None = None
    """A Jinja chat template file replacing the tokenizer's own (exported with the model),
    or 'chatml' (built in; needs <|im_start|> and <|im_end|> in the vocabulary); null: the
    tokenizer's."""
    train_on: Literal["assistant", "completion", "all"] = "assistant"
    """The tokens the loss counts: assistant (chat: every assistant turn; prompt/completion:
    the completion), completion (chat: the last assistant turn; prompt/completion: the
    completion) or all (every token, the prompt's and the template's too). Text trains on
    every token."""
    eos_token: str | None = None
    """A token of the vocabulary to end text and completions with (and export as the
    tokenizer's end token); null: the tokenizer's."""
    seq_len: PositiveInt = 2048
    """Tokens per row (packed) or per example at most; no more than the model's context."""
    packing: bool = True
    """Pack whole examples into rows of seq_len (best-fit decreasing), attention confined to
    each example; false: `padding`."""
    padding: Literal["longest", "free"] = "longest"
    """Without packing: pad each batch to its longest example (attention_mask), or put a
    micro-batch's examples one after the other in one row, no padding (needs max_tokens)."""
    over_long: Literal["truncate", "drop"] = "truncate"
    """An example longer than seq_len: keep its first seq_len tokens, or leave it out
    (either is counted in the log)."""
    batch_size: PositiveInt = 16
    """The GLOBAL micro-batch in rows (packed) or examples (padded), across DP ranks."""
    max_tokens: PositiveInt | None = None
    """A token budget per micro-batch and rank instead of batch_size: padded batches of
    examples of similar length (n x longest <= max_tokens), or padding-free rows."""
    valid_batch_size: PositiveInt = 16
    valid_fraction: float = Field(default=0.05, gt=0, lt=1)
    split_seed: int = 0
    shuffle_seed: int = 0
    cache_dir: str | None = None
    """Where `datasets` keeps the Arrow copies of the files and the tokenised tables;
    null: its own cache (HF_DATASETS_CACHE)."""
    num_workers: PositiveInt | None = None
    """Processes that tokenise (datasets' num_proc); null: one per core, at most 8 and one
    per 2,000 records (`data.sft.tokenizing_processes`)."""

    @model_validator(mode="after")
    def _padding_needs_no_packing(self) -> DataSection:
        if self.packing and self.padding != "longest":  # it would be ignored
            raise ValueError(f"data.padding ({self.padding}) is only used with "
                             "data.packing=false: set data.packing=false, or leave it out")
        return self


class OptimizerSection(OptimizerConfig):
    lr: float = Field(default=2e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.0, ge=0)


class ScheduleSection(LRSchedulerSection):
    type: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    """The decay after the warm-up, to lr * final_lr_scale at num_steps (HF's names;
    constant has no warm-up)."""
    warmup_ratio: float | None = Field(default=None, ge=0, lt=1)
    """Warm-up over ceil(warmup_ratio x the schedule's length) steps, instead of
    warmup_steps."""
    num_steps: PositiveInt | None = None
    """Length of the schedule in steps. null: the first run's: trainer.max_num_steps, or
    trainer.max_num_data_epochs x the steps an epoch takes (the fewer when both are set),
    kept in the checkpoint, so extending a run leaves the rates already taken as they were."""


class SFTConfig(_Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: ScheduleSection = ScheduleSection(warmup_steps=20)
    trainer: TrainerConfig = FINETUNING_TRAINER
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


# Settings a resumed run may not change: the model and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.weights", "data.format", "data.text_field",
                "data.prompt_field", "data.completion_field", "data.messages_field",
                "data.chat_template", "data.train_on", "data.eos_token", "data.seq_len",
                "data.packing", "data.padding",
                "data.over_long", "data.batch_size", "data.max_tokens", "data.valid_fraction",
                "data.split_seed", "data.shuffle_seed", *LoraSection.RESUME_GUARD)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "rows of 2048 tokens, global batch 16, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: rows of 256, 60 steps, fp32",
        "data": {"seq_len": 256, "batch_size": 4, "valid_batch_size": 8,
                 "valid_fraction": 0.1},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 5},
        "trainer": {"max_num_steps": 60, "validate_every_n_steps": 20,
                    "checkpoint_every_n_steps": 20, "publish_metrics_every_n_steps": 10,
                    "dtype": "fp32", "progress": False},
    },
}
