"""Assemble the fine-tuning recipe: gangs, the model's tokenizer, packed windows, the
pretrained model loaded over the gangs (`gangtrain.models.hf.load_pretrained`), the stock causal LM
units and the trainer, which exports the best checkpoint as a HF directory at the end
(`OUTPUT_DIR/hf/`, `gangtrain.models.hf.export_pretrained`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from gangs import Gangs
from gangtrain.app.cli import recipe_gangs, run_recipe
from gangtrain.app.parameter_counts import parameter_line
from gangtrain.app.pretrained import check_layout, evaluate_and_close, report_run
from gangtrain.app.pretrained import load_layout_of as load_pretrained_layout
from gangtrain.data import (
    WindowReader,
    pack_windows,
    read_documents,
    split_windows,
    tokenize_documents,
)
from gangtrain.models.hf import hf_model_of
from gangtrain.models.hf.hf_config import load_tokenizer
from gangtrain.models.hf.layout import HFLayout
from recipes.finetune.config import PRESETS, RESUME_GUARD, FinetuneConfig
from recipes.finetune.data import eval_batches
from trainer.errors import UserError
from trainer.lr_schedules import warmup_cosine
from trainer.observe.console_log import configure_logging

__all__ = ["cli", "eval_main", "load_model", "main"]


def load_model(config: FinetuneConfig, gangs: Gangs) -> nn.Module:
    """The pretrained model of `config.model.path`, ready for the Trainer (`load_layout_of`:
    the module to train, this rank's stages under pipeline parallelism)."""
    return load_layout_of(config, gangs).model


def load_layout_of(config: FinetuneConfig, gangs: Gangs) -> HFLayout:
    """The pretrained model as this rank holds it under the gangs' layout, with its units:
    built on meta, tensor-parallel by its own plan over `gangs.tp`, cut into pipeline stages
    or attending over the cp gang, wrapped over DP, each rank reading its slices of the
    weights; activation checkpointing per block if asked."""
    # Activation checkpointing goes on each block before the model is wrapped (DDP, FSDP2,
    # or FSDP2 for DDP x TP), in one process too.
    layout = load_pretrained_layout(config, gangs)
    hf_model = hf_model_of(layout.model)
    # No KV cache: training never reuses it, and a block recomputed in backward would append
    # its keys and values to it a second time. Passed to each forward (it outranks the
    # config), so the config the checkpoints and OUT/hf/ write keeps the pretrained value.
    # (Pipeline stages pass use_cache=False themselves.)
    if hf_model is not None:
        hf_model.register_forward_pre_hook(_without_kv_cache, with_kwargs=True)
    return layout


def _without_kv_cache(module: nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, {**kwargs, "use_cache": False}


@dataclass
class _Setup:
    """What training and evaluation share: gangs, the (wrapped) model, validation."""

    gangs: Gangs
    console: Console | None
    layout: HFLayout
    valid_units: list[Any]
    valid_readers: list[Iterable[Any]]
    reader: WindowReader | None  # training data; None when only evaluating
    flops_per_token: float


def _setup(config: FinetuneConfig, train: bool) -> _Setup:
    configure_logging()  # on rank 0 only: every line once
    # The user's mistakes first, before any process group or model.
    hf_config, documents = _checked_documents(config)
    d, g = config.data, config.gangs
    gangs, console = recipe_gangs(g.timeout_s, g.tp_size, g.ep_size, g.dp_shard_size,
                                  pp_size=g.pp_size, cp_size=g.cp_size)
    dp_rank, dp_size = gangs.dp.rank, gangs.dp.size

    # Data: every rank tokenises the same documents into the same windows and split.
    tokens = tokenize_documents(documents, load_tokenizer(config.model.path))
    train_windows, valid_windows = split_windows(pack_windows(tokens, d.seq_len),
                                                 d.valid_fraction, d.split_seed, d.batch_size)
    reader = (WindowReader(train_windows, d.batch_size, dp_rank, dp_size, seed=d.shuffle_seed)
              if train else None)
    valid_reader = eval_batches(valid_windows, d.valid_batch_size, dp_rank, dp_size)
    if console:
        console.print(f"data: {len(d.files)} files, {tokens.numel():,} tokens: "
                      f"{len(train_windows):,} train / {len(valid_windows):,} valid windows "
                      f"of {d.seq_len} tokens")

    layout = load_layout_of(config, gangs)
    model = layout.model
    if tokens.numel() and int(tokens.max()) >= hf_config.vocab_size:
        raise UserError(f"config 'model.path': the tokenizer of '{config.model.path}' gives "
                        f"token {int(tokens.max())}, beyond the model's vocab_size "
                        f"{hf_config.vocab_size}: the tokenizer files belong to another model")
    num_params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if console:
        console.print(f"model: {config.model.path}, {parameter_line(model)}")
    return _Setup(gangs, console, layout, [layout.valid_unit()], [valid_reader], reader,
                  _flops_per_token(hf_config, num_params, trained, d.seq_len))


def _checked_documents(config: FinetuneConfig) -> tuple[Any, list[str]]:
    """(the model's HF config, the documents of data.files), after the checks of the model
    directory (as a whole) and of the layout settings that only meet at build time."""
    hf_config = check_layout(config)
    return hf_config, read_documents(config.data.files, config.data.text_field)


def check_inputs(config: FinetuneConfig) -> None:
    """Every input a run needs, opened and checked before the command writes anything
    (`gangtrain.app.cli.run_recipe`): the model directory, the data files, the tokenizer."""
    _checked_documents(config)
    load_tokenizer(config.model.path)


def main(config: FinetuneConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    optimizer = config.optimizer.build(s.layout.model)
    scheduler = warmup_cosine(optimizer, config.lr_scheduler, config.trainer.max_num_steps)
    trainer = config.trainer.build(
        s.layout.train_unit(flops_per_target=s.flops_per_token), s.reader, optimizer,
        output_dir=output_dir, gangs=s.gangs, lr_scheduler=scheduler,
        valid_units=s.valid_units, valid_data_readers=s.valid_readers, resume=resume,
        run_config=config.model_dump(mode="json"),
    )
    result = trainer.run()
    report_run(s.console, result, config.trainer.score_metric, output_dir)
    s.gangs.close()
    return 0


def eval_main(config: FinetuneConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: validate a checkpoint of ``output_dir`` (see `gangtrain.app.evaluate`)."""
    s = _setup(config, train=False)
    evaluate_and_close(s.valid_units, s.valid_readers, output_dir=output_dir, gangs=s.gangs,
                       checkpoint=checkpoint, console=s.console)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.finetune ARGS` as a function: ``cli(["OUT", "--set", ...])``
    returns the exit code (2 for a user mistake, printed as one `error:` line)."""
    return run_recipe(FinetuneConfig, PRESETS, main, argv, prog="python -m recipes.finetune",
                      default_preset="default", resume_guard=RESUME_GUARD,
                      eval_main=eval_main, check_inputs=check_inputs)


def _flops_per_token(hf_config: Any, num_params: int, trained: int, seq_len: int) -> float:
    """Training FLOPs per token for the published MFU: 6 N + 12 L d T (the LM recipe's
    convention, N counting every parameter here). A frozen parameter costs 4 (forward, and
    the gradient of its input in backward), not 6: it has no gradient of its own (LoRA)."""
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    width = getattr(hf_config, "hidden_size", 0) or 0
    return 4.0 * num_params + 2.0 * trained + 12.0 * layers * width * seq_len
