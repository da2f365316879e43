"""Assemble the preference recipe: gangs, the model's tokenizer (`gangtrain.app.pretrained`), the pairs
tokenised once into a cache (`data.preference`), the pretrained policy loaded over the gangs
(`gangtrain.models.hf.load_pretrained`), the reference model, the preference units
(`units.preference`) and the trainer; at the end the best checkpoint is exported to
`OUTPUT_DIR/hf/` with the tokenizer as used (and `OUTPUT_DIR/adapter/` with LoRA).

The reference model, by default and for every layout: a frozen copy of the pretrained model
built by the same plan over the same gangs (TP by the model's plan, FSDP2/HSDP sharded like
the policy under `trainer.data_parallel=fsdp`, whole on each rank under DDP); with LoRA none:
the policy with its adapters disabled; simpo and orpo need none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from torch import nn

from gangs import Gangs, rank0_first
from gangtrain.app.cli import recipe_gangs, run_recipe
from gangtrain.app.parameter_counts import parameter_line
from gangtrain.app.pretrained import (
    check_layout,
    evaluate_and_close,
    load_tokenizer,
    report_run,
)
from gangtrain.data.mixing import hold_out
from gangtrain.data.preference import (
    PairEvalBatches,
    PairFields,
    PairReader,
    plan_pairs,
    tokenize_pairs,
)
from gangtrain.data.sft import Tokenized
from gangtrain.models.hf import load_pretrained
from gangtrain.models.hf.hf_config import check_tokenizer_fits
from recipes.preference.config import PRESETS, RESUME_GUARD, PreferenceConfig
from trainer.errors import UserError
from trainer.lr_schedules import warmup_cosine
from trainer.observe.console_log import configure_logging
from units.preference import PreferenceEvalUnit, PreferenceUnit

__all__ = ["cli", "eval_main", "main", "prepare_pairs"]


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
    fields = PairFields(d.prompt_field, d.chosen_field, d.rejected_field)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id

    def tokenize(files: list[str], setting: str) -> Tokenized:
        return tokenize_pairs(files, tokenizer, name=f"'{config.model.path}'", fields=fields,
                              cache_dir=d.cache_dir, num_proc=d.num_workers, setting=setting)

    if not d.files and (train or not d.valid_files):
        raise UserError("config 'data.files' is empty: list the JSONL, JSON or Parquet files "
                        "of preference pairs, e.g. --set 'data.files=[pairs.jsonl]'")
    pairs = tokenize(list(d.files), "data.files") if d.files else None
    if d.valid_files:
        valid_pairs = tokenize(list(d.valid_files), "data.valid_files")
        kept, held = (np.arange(len(pairs)) if pairs else None), np.arange(len(valid_pairs))
    else:
        assert pairs is not None
        valid_pairs = pairs
        kept, held = hold_out(len(pairs), d.valid_fraction, d.split_seed)
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
    return check_layout(config)


def load_models(config: PreferenceConfig, gangs: Gangs) -> tuple[nn.Module, nn.Module | None]:
    """(the policy, ready for the Trainer; the frozen reference or None, see the module
    docstring)."""
    policy = load_pretrained(config.model.path, gangs,
                             data_parallel=config.trainer.data_parallel,
                             activation_checkpointing=config.model.activation_checkpointing,
                             **config.lora.load_options(config.trainer.seed))
    if config.lora.r is not None or config.loss.kind in ("simpo", "orpo"):
        return policy, None
    sharded = "fsdp" if config.trainer.data_parallel == "fsdp" else None
    return policy, load_pretrained(config.model.path, gangs, data_parallel=sharded)


@dataclass
class _Setup:
    gangs: Gangs
    console: Console | None
    model: nn.Module
    reference: nn.Module | None
    tokenizer: Any
    data: PairData


def _setup(config: PreferenceConfig, train: bool) -> _Setup:
    configure_logging()
    hf_config = check_settings(config)
    config.loss.settings()  # a mistake in the loss before anything is loaded
    tokenizer = load_tokenizer(config.model.path, config.data.chat_template)
    gangs, console = recipe_gangs(config.gangs.timeout_s, config.gangs.tp_size, 1,
                                  config.gangs.dp_shard_size)
    # Rank 0 tokenises into the cache first, the others then read it; a mistake found on
    # rank 0 is raised on every rank.
    data = rank0_first(gangs.root, lambda: prepare_pairs(config, tokenizer, gangs.dp.rank,
                                                     gangs.dp.size, train))
    if console:
        for line in data.summary:
            console.print(f"data {line}")
    check_tokenizer_fits(tokenizer, hf_config, config.model.path)
    model, reference = load_models(config, gangs)
    if console:
        console.print(f"model: {config.model.path}, {parameter_line(model)}; loss "
                      f"{config.loss.kind}, beta {config.loss.beta}; reference: "
                      + ("none" if config.loss.kind in ("simpo", "orpo") else
                         "the base, adapters disabled" if reference is None else "a frozen copy"))
    return _Setup(gangs, console, model, reference, tokenizer, data)


def main(config: PreferenceConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    loss = config.loss.settings()
    optimizer = config.optimizer.build(s.model)
    trainer = config.trainer.build(
        PreferenceUnit(s.model, loss, s.reference), s.data.train, optimizer,
        output_dir=output_dir, gangs=s.gangs,
        lr_scheduler=warmup_cosine(optimizer, config.lr_scheduler, config.trainer.max_num_steps),
        valid_units=[PreferenceEvalUnit(s.model, loss, s.reference)],
        valid_data_readers=[s.data.valid], resume=resume,
        run_config=config.model_dump(mode="json"),
    )
    result = trainer.run()
    report_run(s.console, result, config.trainer.score_metric, output_dir, s.tokenizer)
    s.gangs.close()
    return 0


def eval_main(config: PreferenceConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: score a checkpoint of ``output_dir`` (the pretrained model when it
    has none) on data.valid_files or the held-out pairs: valid/loss is the mean preference
    loss per pair, with the reward metrics."""
    s = _setup(config, train=False)
    unit = PreferenceEvalUnit(s.model, config.loss.settings(), s.reference)
    evaluate_and_close([unit], [s.data.valid], output_dir=output_dir, gangs=s.gangs,
                       checkpoint=checkpoint, console=s.console)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.preference ARGS` as a function; returns the exit code."""
    return run_recipe(PreferenceConfig, PRESETS, main, argv, prog="python -m recipes.preference",
                      default_preset="default", resume_guard=RESUME_GUARD,
                      eval_main=eval_main)
