"""Preference optimisation (`recipes.preference`): DPO, IPO, SimPO and ORPO on TRL's pair
formats (explicit or implicit prompt, conversational or text), the pairs tokenised once into
a cache (`data.preference`), the preference units (`units.preference`); KTO (loss.kind=kto)
on TRL's unpaired format instead (`data.unpaired`). TRL's `DPOConfig`
names map to: `beta` -> loss.beta, `loss_type` -> loss.kind, `label_smoothing`,
`rpo_alpha` -> loss.*, `max_length` -> data.seq_len, `truncation_mode` -> data.over_long
(the prompt is cut first).

The reference model, by default and for every layout: a frozen copy of the pretrained model
built by the same plan over the same gangs (TP by the model's plan, FSDP2/HSDP sharded like
the policy under `trainer.data_parallel=fsdp`, whole on each rank under DDP); with LoRA none:
the policy with its adapters disabled; simpo and orpo need none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, PositiveInt, model_validator

from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig
from gangtrain.app.pretrained import check_layout
from gangtrain.data.mixing import hold_out
from gangtrain.data.preference import (
    PairEvalBatches,
    PairFields,
    PairReader,
    plan_pairs,
    tokenize_pairs,
)
from gangtrain.data.sft import Tokenized, plan_examples
from gangtrain.data.unpaired import (
    KTOEvalBatches,
    KTOReader,
    UnpairedFields,
    tokenize_unpaired,
    with_room,
)
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.models.hf.vision import is_vlm
from gangtrain.posttrain.objective import Objective, Parts
from gangtrain.posttrain.objectives.vision_ddp import policy_options, tower_in_every_forward
from trainer.errors import UserError
from units.preference import KTOLoss, PreferenceEvalUnit, PreferenceLoss, PreferenceUnit

__all__ = ["RESUME_GUARD", "PairData", "PreferenceConfig", "PreferenceObjective",
           "prepare_pairs"]

REFERENCE_FREE = ("simpo", "orpo")

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
    completion_field: str = "completion"
    """loss.kind=kto: TRL's unpaired format (prompt, completion, label) instead of pairs."""
    label_field: str = "label"
    """loss.kind=kto: true for a desirable completion, false for an undesirable one."""
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
    kind: Literal["dpo", "ipo", "simpo", "orpo", "kto"] = "dpo"
    """dpo (sigmoid), ipo, simpo (reference-free, length-normalised), orpo (NLL + odds
    ratio, reference-free), kto (unpaired examples, `data.unpaired`); see
    `units.preference`."""
    beta: float = Field(default=0.1, gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Conservative DPO / SimPO: the share of pairs assumed flipped."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    rpo_alpha: float | None = None
    """Weight of an NLL term on the chosen answer (per token, per pair); null: none."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable example's loss (TRL's name and default)."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable example's loss."""

    def settings(self) -> PreferenceLoss:
        try:
            return PreferenceLoss(self.kind, self.beta, self.label_smoothing,
                                  self.simpo_gamma, self.rpo_alpha,
                                  desirable_weight=self.desirable_weight,
                                  undesirable_weight=self.undesirable_weight)
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

    @model_validator(mode="after")
    def _unpaired_fields_need_kto(self) -> PreferenceConfig:
        for field, default in (("completion_field", "completion"), ("label_field", "label")):
            if self.loss.kind != "kto" and getattr(self.data, field) != default:  # unread
                raise ValueError(f"data.{field} names a field of KTO's unpaired records; "
                                 f"loss.kind is {self.loss.kind}, which trains on pairs: set "
                                 "loss.kind=kto, or leave it out")
        return self


# Settings a resumed run may not change: the model, the loss and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.prompt_field", "data.chosen_field",
                "data.rejected_field", "data.chat_template", "data.seq_len", "data.over_long",
                "data.batch_size", "data.valid_fraction", "data.split_seed",
                "data.shuffle_seed", "loss.kind", "loss.beta", "data.completion_field",
                "data.label_field", *LoraSection.RESUME_GUARD)


@dataclass
class PairData:
    """Every rank's view of the pairs: the same plan on every rank, each its share."""

    train: PairReader | None
    valid: PairEvalBatches
    summary: list[str]


def prepare_pairs(config: PreferenceConfig, tokenizer: Any, dp_rank: int = 0, dp_size: int = 1,
                  train: bool = True) -> PairData:
    """Tokenise (or read from the cache), hold out and plan; the readers of this DP rank."""
    d = config.data
    fields = PairFields(d.prompt_field, d.chosen_field, d.rejected_field,
                        getattr(d, "margin_field", None))  # a reward model's
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id

    def tokenize(files: list[str], setting: str) -> Tokenized:
        return tokenize_pairs(files, tokenizer, name=f"'{config.model.path}'", fields=fields,
                              cache_dir=d.cache_dir, num_proc=d.num_workers, setting=setting)

    pairs, valid_pairs, kept, held = _split(d, tokenize, train, "preference pairs",
                                            "pairs.jsonl")
    valid_bins, valid_empty = plan_pairs(valid_pairs, held, d.seq_len, d.over_long)
    valid = PairEvalBatches(valid_pairs.dataset, valid_bins, d.valid_batch_size, pad_id,
                            dp_rank, dp_size)
    summary = [f"valid: {len(valid_bins):,} pairs of {len(held):,}; {_counts(valid_bins)}, "
               f"{valid_empty} without an answer token left out"]
    reader = None
    if train:
        assert pairs is not None and kept is not None
        bins, empty = plan_pairs(pairs, kept, d.seq_len, d.over_long)
        reader = PairReader(pairs.dataset, bins, d.batch_size, pad_id, dp_rank, dp_size,
                            seed=d.shuffle_seed)
        summary.insert(0, f"train: {len(bins):,} pairs of {len(kept):,}; {_counts(bins)}, "
                          f"{empty} without an answer token left out")
    return PairData(reader, valid, summary)


def _split(d: DataSection, tokenize: Callable[[list[str], str], Tokenized], train: bool,
           what: str, example: str) -> tuple[Tokenized | None, Tokenized, Any, np.ndarray]:
    """(the training table, the validation table, the training rows kept, the validation
    rows): data.valid_files, else data.valid_fraction of data.files held out."""
    if not d.files and (train or not d.valid_files):
        raise UserError(f"config 'data.files' is empty: list the JSONL, JSON or Parquet files "
                        f"of {what}, e.g. --set 'data.files=[{example}]'")
    table = tokenize(list(d.files), "data.files") if d.files else None
    if d.valid_files:
        valid = tokenize(list(d.valid_files), "data.valid_files")
        return table, valid, np.arange(len(table)) if table else None, np.arange(len(valid))
    assert table is not None
    return table, table, *hold_out(len(table), d.valid_fraction, d.split_seed)


def prepare_unpaired(config: PreferenceConfig, tokenizer: Any, dp_rank: int = 0,
                     dp_size: int = 1, train: bool = True) -> PairData:
    """loss.kind=kto: TRL's unpaired examples (`data.unpaired`), held out and planned as
    pairs are; the readers of this DP rank."""
    d = config.data
    fields = UnpairedFields(d.prompt_field, d.completion_field, d.label_field)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id

    def tokenize(files: list[str], setting: str) -> Tokenized:
        return with_room(tokenize_unpaired(
            files, tokenizer, name=f"'{config.model.path}'", fields=fields,
            cache_dir=d.cache_dir, num_proc=d.num_workers, setting=setting), d.seq_len)

    examples, valid_examples, kept, held = _split(
        d, tokenize, train, "KTO examples (prompt, completion, label)", "examples.jsonl")
    valid_bins, valid_empty = plan_examples(valid_examples, held, "padded", d.seq_len,
                                            None, d.over_long)
    valid = KTOEvalBatches(valid_examples.dataset, valid_bins, d.valid_batch_size, pad_id,
                           dp_rank, dp_size)
    summary = [f"valid: {len(valid_bins):,} examples of {len(held):,}; {_counts(valid_bins)}, "
               f"{valid_empty} without a completion token left out"]
    reader = None
    if train:
        assert examples is not None and kept is not None
        bins, empty = plan_examples(examples, kept, "padded", d.seq_len, None, d.over_long)
        reader = KTOReader(examples.dataset, bins, d.batch_size, pad_id, dp_rank, dp_size,
                           seed=d.shuffle_seed, num_accumulate=config.trainer.num_accumulate)
        summary.insert(0, f"train: {len(bins):,} examples of {len(kept):,}; {_counts(bins)}, "
                          f"{empty} without a completion token left out")
    return PairData(reader, valid, summary)  # type: ignore[arg-type]


def _counts(bins: Any) -> str:
    return (f"{bins.num_truncated} truncated, {bins.num_dropped} dropped as longer than "
            f"data.seq_len={bins.seq_len}")


def check_settings(config: PreferenceConfig) -> Any:
    """The model's HF config, after refusing by name the layouts this recipe does not run
    exactly, then what the layout's own rules and the model's family refuse
    (`gangtrain.app.pretrained.check_layout`)."""
    g = config.gangs
    for name, size in (("pp_size", g.pp_size), ("cp_size", g.cp_size), ("ep_size", g.ep_size)):
        if size > 1:
            raise UserError(f"config 'gangs.{name}={size}': recipes.preference runs data and "
                            "tensor parallelism (FSDP2, HSDP, DDP, gangs.tp_size) only: a "
                            "pair's chosen and rejected sides are scored together, which "
                            f"this parallelism does not do yet; set gangs.{name}=1")
    hf_config = check_layout(config)
    if is_vlm(hf_config) and g.tp_size > 1:
        raise UserError(f"config 'gangs.tp_size' is {g.tp_size}: {config.model.path} is a "
                        "vision-language model, trained under data parallelism only (DDP, "
                        "FSDP2/HSDP) for now: set it to 1")
    return hf_config


class PreferenceObjective(Objective):
    """`preference`: a pair's chosen and rejected sides scored together; data, tensor and
    expert-free layouts (FSDP2, HSDP, DDP, TP)."""

    name = "preference"
    config_type = PreferenceConfig
    resume_guard = RESUME_GUARD

    def check(self, config: PreferenceConfig) -> Any:
        hf_config = check_settings(config)
        config.loss.settings()  # a mistake in the loss before anything is loaded
        return hf_config

    def read_data(self, config: PreferenceConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> PairData:
        from gangtrain.posttrain.objectives import preference_images

        if preference_images.uses_image_pairs(config):  # TRL's VLM pairs
            return PairData(*preference_images.prepare_image_pairs(  # type: ignore[arg-type]
                config, tokenizer, dp_rank, dp_size, train))
        if config.loss.kind == "kto":
            return prepare_unpaired(config, tokenizer, dp_rank, dp_size, train)
        return prepare_pairs(config, tokenizer, dp_rank, dp_size, train)

    def load_policy(self, config: PreferenceConfig, a: Any) -> Any:
        layout = a.load_layout(**policy_options(config, a.hf_config))  # (a VLM under DDP)
        tower_in_every_forward(layout.model, a.processor)  # (pairs without images under DP)
        return layout

    def load_reference(self, config: PreferenceConfig, a: Any) -> Any:
        if config.lora.r is not None or config.loss.kind in REFERENCE_FREE:
            return None
        return tower_in_every_forward(a.frozen_copy(), a.processor)  # (FSDP2-sharded too)

    def describe(self, config: PreferenceConfig, a: Any) -> str:
        reference = ("none" if config.loss.kind in REFERENCE_FREE else
                     "the base, adapters disabled" if a.reference is None else "a frozen copy")
        return f"; loss {config.loss.kind}, beta {config.loss.beta}; reference: {reference}"

    def build(self, config: PreferenceConfig, a: Any, data: PairData, train: bool) -> Parts:
        loss = config.loss.settings()
        if isinstance(loss, KTOLoss):  # its KL estimate is the step's, over the DP gang
            loss.bind(a.gangs.dp)
            for model in (a.model, a.reference):  # its rows then run packed (units.packed_rows)
                if model is not None and hf_model_of(model) is not None:
                    use_document_attention(hf_model_of(model))
        unit = PreferenceUnit(a.model, loss, a.reference) if train else None
        return Parts(unit, data.train, [PreferenceEvalUnit(a.model, loss, a.reference)],
                     [data.valid])
