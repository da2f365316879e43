"""Assemble the SFT recipe: gangs, the model's tokenizer (and chat template), the data
tokenised once into a cache with loss masks and packed (`data.sft`), the pretrained model
loaded over the gangs (`gangtrain.models.hf.load_pretrained`), the stock causal-LM units (which hand
`position_ids` to the model: attention stays within each packed example) and the trainer;
at the end the best checkpoint is exported to `OUTPUT_DIR/hf/` with the tokenizer as used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from torch import nn

from gangs import Gangs, rank0_first
from gangtrain.app.cli import recipe_gangs, run_recipe
from gangtrain.app.parameter_counts import parameter_line
from gangtrain.app.pretrained import (
    check_layout,
    evaluate_and_close,
    load_layout_of,
    report_run,
)
from gangtrain.app.pretrained import load_tokenizer as load_recipe_tokenizer
from gangtrain.data.formats import Fields
from gangtrain.data.mixing import hold_out, mix
from gangtrain.data.sft import Tokenized, plan_examples, tokenize_files
from gangtrain.data.token_batches import BinReader, Bins, EvalBatches
from gangtrain.layers.neftune import add_neftune
from gangtrain.models.hf import hf_model_of
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.models.hf.hf_config import check_tokenizer_fits
from gangtrain.models.hf.layout import HFLayout
from recipes.sft.config import PRESETS, RESUME_GUARD, SFTConfig
from trainer.errors import UserError
from trainer.lr_schedules import schedule_length, warmup_decay
from trainer.observe.console_log import configure_logging
from units.causal_lm import CausalLMUnit

__all__ = ["check_inputs", "cli", "eval_main", "load_model", "load_tokenizer", "main",
           "prepare_data"]

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


def load_model(config: SFTConfig, gangs: Gangs) -> HFLayout:
    """The pretrained model as this rank holds it under the gangs' layout, with its units
    (built on meta, TP by its own plan, cut into pipeline stages or attending over the cp
    gang, wrapped over DP, each rank reading its slices of the weights), with the attention
    kernel of `model.attn_implementation` and NEFTune's noise when they are set."""
    layout = load_layout_of(config, gangs, **(
        {"dtype": torch.bfloat16} if config.model.dtype == "bf16" else {}))
    hf_model = hf_model_of(layout.model)  # inside DDP's wrapper; None for pipeline stages
    if config.model.attn_implementation is not None and hf_model is not None:
        try:
            hf_model.set_attn_implementation(config.model.attn_implementation)
        except (ValueError, ImportError) as error:
            raise UserError(f"config 'model.attn_implementation': {error}") from None
    elif hf_model is not None and layout.pipeline is None:
        use_document_attention(hf_model)  # packed rows attend per document, where exact
    if config.model.neftune_noise_alpha is not None and hf_model is not None:
        add_neftune(hf_model.get_input_embeddings(), config.model.neftune_noise_alpha)
    return layout


def check_inputs(config: SFTConfig) -> None:
    """Open and check every input a run will need before anything is written: the model
    directory as a whole, the settings that only meet at build time, the tokenizer, every
    data file (tokenised into the cache, which the run then reads) and the schedule's
    length. A mistake is a `UserError` naming it."""
    _check_settings(config)
    optimizer = config.optimizer.build(nn.Linear(1, 1))  # its name and options
    data = prepare_data(config, load_tokenizer(config))
    warmup_decay(optimizer, config.lr_scheduler, _schedule_length(config, data))


def _check_settings(config: SFTConfig) -> Any:
    """The model's HF config, after a `UserError` naming the first setting that does not fit
    the others or the model (the layout: its family's spec)."""
    hf_config = check_layout(config)
    g = config.gangs
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


def _schedule_length(config: SFTConfig, data: SFTData) -> int | None:
    t = config.trainer
    batches = None if data.train is None else len(data.train)
    return schedule_length(config.lr_scheduler, t.max_num_steps, t.max_num_data_epochs,
                           batches, t.num_accumulate)


@dataclass
class _Setup:
    gangs: Gangs
    console: Console | None
    layout: HFLayout
    tokenizer: Any
    data: SFTData
    valid_unit: Any

    @property
    def model(self) -> nn.Module:
        return self.layout.model


def _setup(config: SFTConfig, train: bool) -> _Setup:
    configure_logging()
    hf_config = _check_settings(config)
    g = config.gangs
    tokenizer = load_tokenizer(config)
    gangs, console = recipe_gangs(g.timeout_s, g.tp_size, g.ep_size, g.dp_shard_size,
                                  pp_size=g.pp_size, cp_size=g.cp_size)
    root = gangs.root
    # Rank 0 reads and tokenises into the cache first; the others then read the cache
    # rather than all converting the same files at once. A mistake found on rank 0 (a bad
    # file, a template that cannot be masked) is raised on every rank, none left waiting.
    data = rank0_first(root, lambda: prepare_data(config, tokenizer, gangs.dp.rank,
                                                     gangs.dp.size, train))
    if console:
        for line in data.summary:
            console.print(f"data {line}")
    check_tokenizer_fits(tokenizer, hf_config, config.model.path)
    layout = load_model(config, gangs)
    if console:
        console.print(f"model: {config.model.path}, {parameter_line(layout.model)}"
                      f"{' (this rank: its pipeline stages)' if gangs.pp.size > 1 else ''}")
    return _Setup(gangs, console, layout, tokenizer, data,
                  layout.valid_unit(token_accuracy=True))


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


def main(config: SFTConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    optimizer = config.optimizer.build(s.model)
    trainer = config.trainer.build(
        _train_unit(s.layout), s.data.train, optimizer, output_dir=output_dir, gangs=s.gangs,
        lr_scheduler=warmup_decay(optimizer, config.lr_scheduler,
                                  _schedule_length(config, s.data)),
        valid_units=[s.valid_unit],
        valid_data_readers=[s.data.valid], resume=resume,
        run_config=config.model_dump(mode="json"),
    )
    result = trainer.run()
    report_run(s.console, result, config.trainer.score_metric, output_dir, s.tokenizer)
    s.gangs.close()
    return 0


def eval_main(config: SFTConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: validate a checkpoint of ``output_dir`` on data.valid_files (or the
    held-out split): valid/loss is the mean NLL per trained (assistant) token."""
    s = _setup(config, train=False)
    evaluate_and_close([s.valid_unit], [s.data.valid], output_dir=output_dir, gangs=s.gangs,
                       checkpoint=checkpoint, console=s.console)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.sft ARGS` as a function; returns the exit code."""
    return run_recipe(SFTConfig, PRESETS, main, argv, prog="python -m recipes.sft",
                      default_preset="default", resume_guard=RESUME_GUARD,
                      eval_main=eval_main, check_inputs=check_inputs)
