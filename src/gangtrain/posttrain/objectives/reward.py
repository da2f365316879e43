"""Reward modelling (`recipes.reward`): a Bradley-Terry model from a causal LM's files, built
as `AutoModelForSequenceClassification` with one label (its `score` head drawn from the
run's seed, the same on every layout; the causal LM's head not read), trained on TRL's
preference formats (`data.preference`: explicit or implicit prompt, conversational or text)
with `units.reward`'s loss, kept best on ``valid/accuracy``; ``OUT/hf/`` is then a
sequence-classification directory that `AutoModelForSequenceClassification.from_pretrained`
loads and that scores as the run did (``pad_token_id`` in its config: the score is read at
the last token that is not padding), and that `recipes.grpo` takes as a reward source
(``rewards=[{model: OUT/hf}]``).

TRL's `RewardConfig` names map to: `center_rewards_coefficient` -> loss.*, `max_length`
-> data.seq_len (TRL drops longer pairs: data.over_long=drop; the default cuts the prompt
first), `learning_rate` -> optimizer.lr (TRL's 1e-4), a ``margin`` column ->
data.margin_field.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig
from gangtrain.app.pretrained import check_layout
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.posttrain.objective import Objective, Parts, data_parallel_only
from gangtrain.posttrain.objectives.preference import (
    DataSection as PairSection,
)
from gangtrain.posttrain.objectives.preference import (
    ModelSection,
    PairData,
    prepare_pairs,
)
from units.reward import RewardEvalUnit, RewardLoss, RewardUnit

__all__ = ["RESUME_GUARD", "RewardConfig", "RewardObjective"]


class OptimizerSection(AdamWConfig):
    """AdamW with TRL's RewardConfig defaults (lr 1e-4, no weight decay)."""

    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class DataSection(PairSection):
    margin_field: str = "margin"
    """A number per pair subtracted from r_chosen - r_rejected (TRL's ``margin`` column):
    read from files that have the field, 0 for files without it."""


class RewardConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    loss: RewardLoss = RewardLoss()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection(warmup_steps=10)
    trainer: TrainerConfig = FINETUNING_TRAINER.model_copy(
        update={"score_metric": "valid/accuracy"})
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


# Settings a resumed run may not change: the model, the loss and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.prompt_field", "data.chosen_field",
                "data.rejected_field", "data.margin_field", "data.chat_template",
                "data.seq_len", "data.over_long", "data.batch_size", "data.valid_fraction",
                "data.split_seed", "data.shuffle_seed", "loss.center_rewards_coefficient",
                *LoraSection.RESUME_GUARD)


class RewardObjective(Objective):
    """`reward`: a pair's two sides scored in one forward; data-parallel layouts (FSDP2,
    HSDP, DDP), with or without LoRA (the `score` head then trains beside the adapters)."""

    name = "reward"
    config_type = RewardConfig
    resume_guard = RESUME_GUARD

    def check(self, config: RewardConfig) -> Any:
        data_parallel_only(config, "recipes.reward",
                           "the score head is not split over other gangs yet")
        return check_layout(config)

    def read_data(self, config: RewardConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> PairData:
        return prepare_pairs(config, tokenizer, dp_rank, dp_size, train)  # type: ignore[arg-type]

    def load_policy(self, config: RewardConfig, a: Any) -> Any:
        # The score head drawn from the run's seed (TRL: the model's init under set_seed).
        return a.load_layout(head="sequence_classification",
                             head_config={"num_labels": 1, "pad_token_id": a.pad_id},
                             seed=config.trainer.seed or 0,
                             trainable=("score",) if config.lora.r is not None else ())

    def describe(self, config: RewardConfig, a: Any) -> str:
        c = config.loss.center_rewards_coefficient
        return f"; a reward model (one label){'' if c is None else f', centring {c}'}"

    def build(self, config: RewardConfig, a: Any, data: PairData, train: bool) -> Parts:
        hf_model = hf_model_of(a.model)
        if hf_model is not None:
            use_document_attention(hf_model)  # the unit then packs each batch's rows
        unit = RewardUnit(a.model, config.loss) if train else None
        return Parts(unit, data.train, [RewardEvalUnit(a.model, config.loss)], [data.valid])
