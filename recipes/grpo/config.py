"""The `recipes.grpo` config: the shared lr_scheduler, trainer, gangs and lora sections, and
its own model, optimizer (TRL's GRPOConfig defaults), data (prompts), generation, loss and
rewards. docs/grpo.md maps every `GRPOConfig` option to these settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator

from gangtrain.app.config.import_path import import_object
from gangtrain.app.config.optimizers import OptimizerConfig
from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, TrainerConfig
from trainer.errors import UserError
from units.online_rl import GRPOLoss


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json, safetensors weights, tokenizer
    files with a chat template for conversational prompts). Required."""
    activation_checkpointing: bool = False


class OptimizerSection(OptimizerConfig):
    """AdamW with TRL's GRPOConfig defaults (lr 1e-6, no weight decay), or another
    torch.optim class by `optimizer.name`."""

    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class DataSection(Section):
    files: list[str] = []
    """Prompts: JSONL or JSON files (or directories of them), TRL's prompt-only forms: a
    `prompt` field holding text or messages; other fields go to the reward functions."""
    valid_files: list[str] = []
    """Held-out prompts: validation generates one greedy completion each and records
    valid/reward; empty: no validation."""
    prompt_field: str = "prompt"
    chat_template: str | None = None
    """A Jinja chat template file replacing the tokenizer's own; null: the tokenizer's."""
    batch_size: PositiveInt = 8
    """The GLOBAL micro-batch in completions, across DP ranks (TRL's
    per_device_train_batch_size x processes)."""
    valid_batch_size: PositiveInt = 16
    """Held-out prompts a validation micro-batch, across DP ranks."""
    shuffle_seed: int = 0


class GenerationSection(Section):
    num_generations: int = Field(default=8, ge=2)
    """Completions a prompt: the group size."""
    max_new_tokens: PositiveInt = 256
    """TRL's max_completion_length."""
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    window: PositiveInt | None = None
    """Micro-batches generated at once (TRL's steps_per_generation); null: the trainer's
    num_accumulate. Independent of the accumulation: the loss is normalised per optimizer
    step whatever it is."""
    replay: str | None = None
    """A run's directory (or its rollouts/): train on its recorded completions and rewards
    instead of sampling."""
    write_rollouts: bool = True
    """Write OUT/rollouts/step_N.jsonl for every window."""


class LossSection(Section):
    kind: Literal["grpo", "dapo", "dr_grpo", "rloo"] = "grpo"
    """grpo (per-completion token mean), dapo (token sum over the step's tokens), dr_grpo
    (token sum over completions x max_new_tokens), rloo (leave-one-out baseline, sequence
    ratio); see units.online_rl.losses."""
    beta: float = Field(default=0.0, ge=0)
    """KL to the reference (k3 as TRL; rloo: k1 in the reward); 0: no reference loaded."""
    epsilon: float = Field(default=0.2, ge=0, lt=1)
    epsilon_high: float | None = Field(default=None, ge=0)
    """The upper clip (DAPO's clip-higher: 0.28); null: epsilon."""
    num_iterations: PositiveInt = 1
    """Updates per generation window (TRL's mu)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """The std advantages are divided by: the group's, the window's, none (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens out of the loss and of its denominator."""

    def settings(self, max_new_tokens: int) -> GRPOLoss:
        try:
            return GRPOLoss(self.kind, self.beta, self.epsilon, self.epsilon_high,
                            self.num_iterations, self.scale_rewards,
                            self.mask_truncated_completions, max_new_tokens)
        except ValueError as error:
            raise UserError(f"config {error}") from None


class GRPOConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    generation: GenerationSection = GenerationSection()
    loss: LossSection = LossSection()
    rewards: list[str] = []
    """Reward functions by import path, 'package.module:function' (TRL's convention)."""
    reward_weights: list[float] | None = None
    """One weight per reward function; null: all 1."""
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection(warmup_steps=0)
    trainer: TrainerConfig = FINETUNING_TRAINER.model_copy(update={
        "score_metric": "valid/reward", "validate_every_n_steps": 50,
        "checkpoint_every_n_steps": 50})
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()

    @field_validator("rewards")
    @classmethod
    def _importable(cls, paths: list[str]) -> list[str]:
        for path in paths:  # imported under the config's import gate: named, not recorded
            fn = import_object(path, "reward function")
            if not callable(fn):
                raise ValueError(f"reward function '{path}' is a {type(fn).__name__}, not "
                                 "callable")
        return paths


# Settings a resumed run may not change: the model, the loss and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.prompt_field", "data.chat_template",
                "data.batch_size", "data.shuffle_seed", "generation.num_generations",
                "generation.max_new_tokens", "generation.window", "generation.replay",
                "loss.kind", "loss.beta", "loss.num_iterations", "rewards", "reward_weights",
                *LoraSection.RESUME_GUARD)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "8 completions a prompt, global micro-batch 8 completions, completions of up "
                "to 256 tokens, GRPO, lr 1e-6, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: 4 completions a prompt of up to 12 "
                "tokens, 8 a micro-batch, 20 steps, lr 1e-3, fp32, DDP",
        "data": {"batch_size": 8, "valid_batch_size": 8},
        "generation": {"num_generations": 4, "max_new_tokens": 12},
        "optimizer": {"lr": 1e-3},
        "trainer": {"max_num_steps": 20, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 5,
                    "dtype": "fp32", "progress": False, "data_parallel": "ddp"},
    },
}

