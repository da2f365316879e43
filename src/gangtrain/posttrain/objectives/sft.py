"""Supervised fine-tuning (`recipes.sft`): a local Hugging Face causal LM on conversations
(`messages`), prompt/completion pairs or plain text, in JSONL, JSON or Parquet; tokenised once
into a cache with loss masks and packed (`data.sft`); the loss on assistant (completion)
tokens only; the stock causal-LM units (which hand `position_ids` to the model: attention
stays within each packed example). docs/sft.md maps TRL's `SFTConfig` names to the config's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt, model_validator
from torch import nn
from torch.optim import Optimizer

from gangs import Gangs
from gangtrain.app.config.optimizers import OptimizerConfig, build_optimizer
from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, TrainerConfig
from gangtrain.app.pretrained import check_layout, load_layout_of
from gangtrain.app.pretrained import load_tokenizer as load_recipe_tokenizer
from gangtrain.data.formats import Fields
from gangtrain.data.mixing import hold_out, mix
from gangtrain.data.sft import Tokenized, plan_examples, tokenize_files
from gangtrain.data.token_batches import BinReader, Bins, EvalBatches
from gangtrain.layers.neftune import add_neftune
from gangtrain.models.hf import hf_model_of, vision
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.models.hf.hf_config import read_hf_config
from gangtrain.models.hf.layout import HFLayout
from gangtrain.posttrain.objective import Objective, Parts
from gangtrain.posttrain.objectives.vision_ddp import policy_options, tower_in_every_forward
from trainer.errors import UserError
from trainer.lr_schedules import schedule_length, warmup_decay
from units.causal_lm import CausalLMUnit

__all__ = ["RESUME_GUARD", "SFTConfig", "SFTData", "SFTObjective", "prepare_data"]

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
    freeze: list[str] = []
    """Parameters kept as loaded: module-name patterns (fnmatch over parameter names, e.g.
    'model.vision_tower.*') or a vision-language model's parts: vision_tower, projector,
    language_model, lm_head. A pattern that matches nothing is an error."""
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
    per 2,000 records (`data.sft.tokenizing_processes`). Image records (read per example,
    nothing tokenised up front): the loader's worker processes that decode the images and
    run the processor ahead of the step; null: none (in the training process)."""

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
    part_lr: dict[str, float] = {}
    """Learning rates of their own (VeOmni's vit_lr), by a vision-language model's part
    (vision_tower, projector, language_model, lm_head) or an fnmatch pattern over parameter
    names: {vision_tower: 2.0e-6}; the schedule scales each alike. Empty: lr for all."""

    def build(self, model: nn.Module) -> Optimizer:  # type: ignore[override]
        if not self.part_lr:
            return super().build(model)
        hf_model = hf_model_of(model)
        return build_optimizer(self, model, vision.lr_groups(
            model if hf_model is None else hf_model, self.part_lr))


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
                "data.split_seed", "data.shuffle_seed", "model.freeze", "optimizer.part_lr",
                *LoraSection.RESUME_GUARD)


@dataclass
class SFTData:
    """Every rank's view of the data: the same plan on every rank, each its share."""

    train: BinReader | None
    valid: EvalBatches
    train_bins: Bins | None
    valid_bins: Bins
    summary: list[str]


def load_tokenizer(config: SFTConfig) -> Any:
    """The tokenizer of `model.path`, with `data.chat_template` in place of its own and
    `data.eos_token` as its end token (`gangtrain.app.pretrained.load_tokenizer`)."""
    return load_recipe_tokenizer(config.model.path, config.data.chat_template,
                                 config.data.eos_token)


def _tokenize(config: SFTConfig, tokenizer: Any, files: list[str], setting: str) -> Tokenized:
    d = config.data
    fields = Fields(d.text_field, d.prompt_field, d.completion_field, d.messages_field)
    return tokenize_files(files, tokenizer, name=f"'{config.model.path}'", fmt=d.format,
                          fields=fields, cache_dir=d.cache_dir, num_proc=d.num_workers,
                          setting=setting, train_on=d.train_on)


def prepare_data(config: SFTConfig, tokenizer: Any, dp_rank: int = 0, dp_size: int = 1,
                 train: bool = True) -> SFTData:
    """Tokenise (or read from the cache), hold out, mix and plan; the readers of this DP
    rank. Every rank computes the same plan from the same files and seeds."""
    d = config.data
    layout = "packed" if d.packing else ("padding_free" if d.padding == "free" else "padded")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    # One dataset per entry of data.files (a file or a directory of shards), one table.
    parts = [_tokenize(config, tokenizer, [f], "data.files") for f in d.files] if d.files \
        else []
    if not parts and (train or not d.valid_files):
        raise UserError("config 'data.files' is empty: list the JSONL, JSON or Parquet files "
                        "to train on, e.g. --set 'data.files=[chat.jsonl]'")
    summary = []
    train_sets, valid_sets, offset = [], [], 0
    for part in parts:
        if d.valid_files:
            kept, held = np.arange(len(part)), np.empty(0, dtype=np.int64)
        else:
            kept, held = hold_out(len(part), d.valid_fraction, d.split_seed)
        train_sets.append(kept + offset)
        valid_sets.append(held + offset)
        offset += len(part)
    if d.valid_files:
        valid_tok = _tokenize(config, tokenizer, list(d.valid_files), "data.valid_files")
        valid_selected = np.arange(len(valid_tok))
    else:
        valid_tok = _concat(parts)
        valid_selected = np.concatenate(valid_sets)
    valid_bins, valid_empty = plan_examples(valid_tok, valid_selected, layout, d.seq_len,
                                            d.max_tokens, d.over_long)
    valid = EvalBatches(valid_tok.dataset, valid_bins,
                        d.valid_batch_size if d.max_tokens is None else dp_size, pad_id,
                        dp_rank, dp_size)
    summary.append(f"valid: {len(valid_selected):,} examples, {valid_bins.describe()}")
    reader, train_bins = None, None
    if train:
        train_tok = _concat(parts)
        selected = mix(train_sets, d.weights, d.shuffle_seed)
        train_bins, empty = plan_examples(train_tok, selected, layout, d.seq_len,
                                          d.max_tokens, d.over_long)
        batch_size = d.batch_size if d.max_tokens is None else dp_size
        reader = BinReader(train_tok.dataset, train_bins, batch_size, pad_id, dp_rank, dp_size,
                           seed=d.shuffle_seed)
        formats = ", ".join(sorted({p.format for p in parts}))
        summary.insert(0, f"train: {len(selected):,} examples ({formats}"
                          f"{', mixed' if d.weights else ''}), {train_bins.describe()}; "
                          f"{empty} without a trained token left out")
    return SFTData(reader, valid, train_bins, valid_bins, summary)


def _concat(parts: list[Tokenized]) -> Tokenized:
    """One table of the datasets of data.files, each tokenised by its own format (a chat
    file and a prompt/completion file mix fine: both are token ids with their targets)."""
    if len(parts) == 1:
        return parts[0]
    from datasets import concatenate_datasets

    return Tokenized(concatenate_datasets([p.dataset for p in parts]),
                     "+".join(sorted({p.format for p in parts})),
                     np.concatenate([p.lengths for p in parts]),
                     np.concatenate([p.num_targets for p in parts]))


def load_model(config: SFTConfig, gangs: Gangs, spec: Any = None) -> HFLayout:
    """The pretrained model as this rank holds it under the gangs' layout, with its units
    (built on meta, TP by its own plan, cut into pipeline stages or attending over the cp
    gang, wrapped over DP, each rank reading its slices of the weights), with the attention
    kernel of `model.attn_implementation` and NEFTune's noise when they are set."""
    layout = load_layout_of(
        config, gangs, spec=spec, freeze=tuple(config.model.freeze),
        **policy_options(config, read_hf_config(Path(config.model.path))),  # (a VLM under DDP)
        **({"dtype": torch.bfloat16} if config.model.dtype == "bf16" else {}))
    hf_model = hf_model_of(layout.model)  # inside DDP's wrapper; None for pipeline stages
    image_text = hf_model is not None and vision.is_vlm(hf_model)
    if image_text:
        vision.prepare_for_packed_rows(hf_model)
    if config.model.attn_implementation is not None and hf_model is not None:
        try:
            hf_model.set_attn_implementation(config.model.attn_implementation)
        except (ValueError, ImportError) as error:
            raise UserError(f"config 'model.attn_implementation': {error}") from None
    elif hf_model is not None and layout.pipeline is None and not image_text:
        # (A VLM keeps transformers' sdpa, which attends per document in packed rows from
        # the restarting position_ids; this kernel would also reach the non-causal tower.)
        use_document_attention(hf_model)  # packed rows attend per document, where exact
    if config.model.neftune_noise_alpha is not None and hf_model is not None:
        add_neftune(hf_model.get_input_embeddings(), config.model.neftune_noise_alpha)
    return layout


def check_settings(config: SFTConfig) -> Any:
    """The model's HF config, after a `UserError` naming the first setting that does not fit
    the others or the model (the layout: its family's spec)."""
    hf_config = check_layout(config)
    g = config.gangs
    sizes = {"tp_size": g.tp_size, "pp_size": g.pp_size, "cp_size": g.cp_size}
    split = next((name for name, size in sizes.items() if size > 1), None)
    if vision.is_vlm(hf_config) and split is not None:
        raise UserError(f"config 'gangs.{split}' is {sizes[split]}: {config.model.path} is a "
                        "vision-language model, trained under data parallelism only (DDP, "
                        "FSDP2/HSDP) for now: set it to 1")
    if g.pp_size > 1 and not config.data.packing:
        raise UserError(f"config 'data.packing' is false; with gangs.pp_size {g.pp_size} it "
                        "must be true: a pipeline schedule runs micro-batches of one shape "
                        "(packed rows of data.seq_len)")
    for setting, value in (("attn_implementation", config.model.attn_implementation),
                           ("neftune_noise_alpha", config.model.neftune_noise_alpha)):
        if value is not None and (g.pp_size > 1 or g.cp_size > 1):
            raise UserError(f"config 'model.{setting}' is not supported with gangs.pp_size "
                            "or gangs.cp_size > 1 (the stages and the context-parallel "
                            "attention run their own kernels): unset it")
    if config.model.dtype is not None and config.lora.r is not None:
        raise UserError("config 'model.dtype' is for full fine-tuning: with LoRA the frozen "
                        "base's dtype is lora.base_dtype")
    if config.model.neftune_noise_alpha is not None and config.gangs.tp_size > 1:
        raise UserError("config 'model.neftune_noise_alpha' (NEFTune) is not supported with "
                        "gangs.tp_size > 1 (the noise would differ between TP ranks)")
    return hf_config


def _schedule_length(config: SFTConfig, data: SFTData | None) -> int | None:
    t = config.trainer
    batches = None if data is None or data.train is None else len(data.train)
    return schedule_length(config.lr_scheduler, t.max_num_steps, t.max_num_data_epochs,
                           batches, t.num_accumulate)


class _TokenCountingUnit(CausalLMUnit):
    """The stock unit, also counting the tokens the model runs on (`num_tokens`: the rows'
    tokens, padding left out where an attention_mask marks it), from which the Trainer
    publishes `tokens_per_s` beside `targets_per_s`."""

    def __call__(self, batch: Any, metrics: Any) -> Any:
        mask = batch.get("attention_mask")
        metrics.update_sum("num_tokens", batch["input_ids"].numel() if mask is None
                           else mask.sum())
        return super().__call__(batch, metrics)


def _train_unit(layout: HFLayout) -> Any:
    """The layout's unit; the stock one also counts the tokens it runs on."""
    return layout.train_unit() if layout.pipeline is not None else _TokenCountingUnit(layout.model)


class SFTObjective(Objective):
    """`sft`: the causal-LM loss on the trained tokens, under every layout (TP, PP, CP, EP,
    FSDP2/HSDP, DDP); the valid unit reports loss, perplexity and token accuracy."""

    name = "sft"
    config_type = SFTConfig
    resume_guard = RESUME_GUARD

    def check(self, config: SFTConfig) -> Any:
        return check_settings(config)

    def read_data(self, config: SFTConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> SFTData:
        from gangtrain.posttrain.objectives import sft_images

        if sft_images.uses_images(config):
            hf_config = read_hf_config(Path(config.model.path))
            if not vision.is_vlm(hf_config):
                raise UserError(f"config 'data.files' holds images, but {config.model.path} "
                                "is not a vision-language model (no vision_config)")
            processor = vision.processor_as_used(config.model.path, tokenizer)
            return SFTData(*sft_images.prepare_image_data(
                config, processor, hf_config.model_type, dp_rank, dp_size, train))
        return prepare_data(config, tokenizer, dp_rank, dp_size, train)

    def describe(self, config: SFTConfig, a: Any) -> str:
        hf_model = hf_model_of(a.model)
        if hf_model is None or not vision.is_vlm(hf_model):
            return ""
        return f"; {vision.trained_summary(hf_model)}"

    def load_policy(self, config: SFTConfig, a: Any) -> HFLayout:
        layout = load_model(config, a.gangs, a.spec)
        tower_in_every_forward(layout.model, a.processor)
        return layout

    def build(self, config: SFTConfig, a: Any, data: SFTData, train: bool) -> Parts:
        layout = a.policy
        unit = None
        if train:  # the layout's unit; the stock one also counts the tokens it runs on
            unit = layout.train_unit() if layout.pipeline is not None \
                else _TokenCountingUnit(layout.model)
        return Parts(unit, data.train, [layout.valid_unit(token_accuracy=True)], [data.valid],
                     lr_schedule_length=_schedule_length(config, data))

    def lr_scheduler(self, config: SFTConfig, optimizer: Optimizer, parts: Parts) -> Any:
        return warmup_decay(optimizer, config.lr_scheduler, parts.lr_schedule_length)

    def check_inputs(self, config: SFTConfig, tokenizer: Any) -> None:
        optimizer = config.optimizer.build(nn.Linear(1, 1))  # its name and options
        data = self.read_data(config, tokenizer, 0, 1, True)
        warmup_decay(optimizer, config.lr_scheduler, _schedule_length(config, data))
