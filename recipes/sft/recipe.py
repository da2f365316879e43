"""Assemble the SFT recipe: gangs, the model's tokenizer (and chat template), the data
tokenised once into a cache with loss masks and packed (`data.sft`), the pretrained model
loaded over the gangs (`trainer.hf.load_pretrained`), the stock causal-LM units (which hand
`position_ids` to the model: attention stays within each packed example) and the trainer;
at the end the best checkpoint is exported to `OUTPUT_DIR/hf/` with the tokenizer as used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from torch import nn

from data.formats import Fields
from data.mixing import hold_out, mix
from data.sft import Tokenized, plan_examples, tokenize_files
from data.token_batches import BinReader, Bins, EvalBatches
from gangs import Gangs, first_error
from models.hf.document_attention import use_document_attention
from parallel import check_hsdp
from recipes.sft.config import PRESETS, RESUME_GUARD, SFTConfig
from trainer.cli import recipe_gangs, run_recipe
from trainer.errors import UserError
from trainer.evaluate import evaluate
from trainer.hf import load_pretrained
from trainer.hf.hf_config import check_model_dir
from trainer.lr_schedules import warmup_cosine
from trainer.observe.console_log import configure_logging
from trainer.result import TrainResult
from trainer.run_dir import RunDir
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit

__all__ = ["cli", "eval_main", "load_tokenizer", "main", "prepare_data"]

@dataclass
class SFTData:
    """Every rank's view of the data: the same plan on every rank, each its share."""

    train: BinReader | None
    valid: EvalBatches
    train_bins: Bins | None
    valid_bins: Bins
    summary: list[str]


def load_tokenizer(config: SFTConfig) -> Any:
    """The tokenizer of `model.path`, with `data.chat_template` in place of its own."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    if config.data.chat_template is not None:
        path = Path(config.data.chat_template)
        if not path.is_file():
            raise UserError(f"config 'data.chat_template': no such file: '{path}'")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of '{config.model.path}' has neither a pad nor an end "
                        "token to pad rows with")
    return tokenizer


def _tokenize(config: SFTConfig, tokenizer: Any, files: list[str], setting: str) -> Tokenized:
    d = config.data
    fields = Fields(d.text_field, d.prompt_field, d.completion_field, d.messages_field)
    return tokenize_files(files, tokenizer, name=f"'{config.model.path}'", fmt=d.format,
                          fields=fields, cache_dir=d.cache_dir, num_proc=d.num_workers,
                          setting=setting)


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
        summary.insert(0, f"train: {len(selected):,} examples ({parts[0].format}"
                          f"{', mixed' if d.weights else ''}), {train_bins.describe()}; "
                          f"{empty} without a trained token left out")
    return SFTData(reader, valid, train_bins, valid_bins, summary)


def _concat(parts: list[Tokenized]) -> Tokenized:
    if len(parts) == 1:
        return parts[0]
    from datasets import concatenate_datasets

    formats = {p.format for p in parts}
    if len(formats) > 1:
        raise UserError(f"the datasets of data.files have different formats {sorted(formats)}: "
                        "each is tokenised by its own, mixing them is fine, but data.format "
                        "must then be unset")
    return Tokenized(concatenate_datasets([p.dataset for p in parts]), parts[0].format,
                     np.concatenate([p.lengths for p in parts]),
                     np.concatenate([p.num_targets for p in parts]))


def load_model(config: SFTConfig, gangs: Gangs) -> nn.Module:
    """The pretrained model, ready for the Trainer (built on meta, TP by its own plan,
    wrapped over DP, each rank reading its slices of the weights)."""
    return load_pretrained(config.model.path, gangs, data_parallel=config.trainer.data_parallel,
                           activation_checkpointing=config.model.activation_checkpointing,
                           **config.lora.load_options(config.trainer.seed))


@dataclass
class _Setup:
    gangs: Gangs
    console: Console | None
    model: nn.Module
    tokenizer: Any
    data: SFTData
    valid_unit: CausalLMEvalUnit


def _setup(config: SFTConfig, train: bool) -> _Setup:
    configure_logging()
    hf_config = check_model_dir(config.model.path, config.data.seq_len)
    try:
        check_hsdp(config.trainer.data_parallel, config.gangs.dp_shard_size)
    except ValueError:
        raise UserError("config 'gangs.dp_shard_size' (HSDP) needs "
                        "trainer.data_parallel=fsdp") from None
    tokenizer = load_tokenizer(config)
    gangs, console = recipe_gangs(config.gangs.timeout_s, config.gangs.tp_size, 1,
                                  config.gangs.dp_shard_size)
    root = gangs.root
    # Rank 0 reads and tokenises into the cache first; the others then read the cache
    # rather than all converting the same files at once. A mistake found on rank 0 (a bad
    # file, a template that cannot be masked) is raised on every rank, none left waiting.
    data, message = None, None
    if root.rank == 0:
        try:
            data = prepare_data(config, tokenizer, gangs.dp.rank, gangs.dp.size, train)
        except UserError as error:
            message = str(error)
    message = first_error(root, message)
    if message is not None:
        raise UserError(message)
    if data is None:
        data = prepare_data(config, tokenizer, gangs.dp.rank, gangs.dp.size, train)
    if console:
        for line in data.summary:
            console.print(f"data {line}")
    if len(tokenizer) > hf_config.vocab_size:
        raise UserError(f"the tokenizer of '{config.model.path}' has {len(tokenizer)} tokens, "
                        f"beyond the model's vocab_size {hf_config.vocab_size}")
    model = load_model(config, gangs)
    use_document_attention(model)  # packed rows attend per document, where exact (#48)
    if console:
        console.print(f"model: {config.model.path}, "
                      f"{sum(p.numel() for p in model.parameters()):,} parameters")
    return _Setup(gangs, console, model, tokenizer, data,
                  CausalLMEvalUnit(model, token_accuracy=True))


def main(config: SFTConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    optimizer = config.optimizer.build(s.model)
    trainer = config.trainer.build(
        CausalLMUnit(s.model), s.data.train, optimizer, output_dir=output_dir, gangs=s.gangs,
        lr_scheduler=warmup_cosine(optimizer, config.lr_scheduler, config.trainer.max_num_steps),
        valid_units=[s.valid_unit],
        valid_data_readers=[s.data.valid], resume=resume,
        run_config=config.model_dump(mode="json"),
    )
    result = trainer.run()
    exported = RunDir(output_dir).hf
    if s.console:
        if exported.is_dir():  # the tokenizer as this run used it, chat template included
            s.tokenizer.save_pretrained(exported)
        _summary(s.console, result, config, exported)
    s.gangs.close()
    return 0


def eval_main(config: SFTConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: validate a checkpoint of ``output_dir`` on data.valid_files (or the
    held-out split): valid/loss is the mean NLL per trained (assistant) token."""
    s = _setup(config, train=False)
    evaluate([s.valid_unit], [s.data.valid], output_dir=output_dir, gangs=s.gangs,
             checkpoint=checkpoint, console=s.console)
    s.gangs.close()
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.sft ARGS` as a function; returns the exit code."""
    return run_recipe(SFTConfig, PRESETS, main, argv, prog="python -m recipes.sft",
                      default_preset="default", resume_guard=RESUME_GUARD,
                      eval_main=eval_main)


def _summary(console: Console, result: TrainResult, config: SFTConfig,
             exported: Path) -> None:
    console.print(f"stopped after step {result.num_steps}: {result.stop_reason}")
    if result.best_score is not None:
        console.print(f"best {config.trainer.score_metric}: {result.best_score:.4f} at step "
                      f"{result.best_step}")
    if result.best_checkpoint is not None and exported.is_dir():
        console.print(f"exported {result.best_checkpoint} as a Hugging Face model: {exported}")
