"""Assemble the LM recipe: gangs, data, the GPT (`gangtrain.models.gpt`: built and refused
by its family), unit, optimizer, schedule, trainer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from gangs import Gangs
from gangtrain.app.cli import recipe_gangs
from gangtrain.app.evaluate import evaluate
from gangtrain.models.gpt.build import build_model, build_pipelined_model
from gangtrain.models.gpt.model import GPTConfig, flops_per_token, num_parameters
from gangtrain.models.gpt.spec import GPT_SPEC
from gangtrain.parallel.pipeline import PipelinedModel
from gangtrain.parallel.spec import LayoutSizes
from recipes.lm.config import LMConfig
from recipes.lm.data import (
    ByteWindowReader,
    eval_batches,
    find_source_files,
    gzip_bits_per_byte,
    load_bytes,
    split_files,
)
from trainer.lr_schedules import warmup_cosine
from trainer.observe.console_log import configure_logging
from trainer.run_dir import RunDir
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.pipeline import PipelineLMEvalUnit, PipelineLMUnit


@dataclass
class _Setup:
    """What training and evaluation share: gangs, the (wrapped) model, validation."""

    gangs: Gangs
    console: Console | None
    model: torch.nn.Module
    valid_units: list[CausalLMEvalUnit]
    valid_readers: list[Iterable[Any]]
    gzip_bpb: float
    reader: ByteWindowReader | None  # training data; None when only evaluating
    flops_per_token: float  # training FLOPs, for the published MFU
    pipeline: PipelinedModel | None = None  # this rank's stages under pipeline parallelism


def _setup(config: LMConfig, train: bool) -> _Setup:
    configure_logging()  # on rank 0 only: every line once
    config.gangs.check(config.trainer.data_parallel)
    check_pp_cp_config(config)
    g = config.gangs
    gangs, console = recipe_gangs(g.timeout_s, g.tp_size, g.ep_size, g.dp_shard_size,
                                  soft_wrap=False, pp_size=g.pp_size, cp_size=g.cp_size)
    dp_rank, dp_size = gangs.dp.rank, gangs.dp.size

    # Data: one global order of windows, each DP rank takes its slice of every batch.
    d = config.data
    train_files, valid_files = split_files(find_source_files(d.root), d.valid_fraction,
                                           d.split_seed)
    reader = None
    if train:
        train_bytes = load_bytes(train_files, d.max_train_bytes)
        reader = ByteWindowReader(train_bytes, d.seq_len, d.batch_size, dp_rank, dp_size,
                                  seed=d.shuffle_seed)
    valid_bytes = load_bytes(valid_files, d.max_valid_bytes)
    valid_reader = eval_batches(valid_bytes, d.seq_len, d.valid_batch_size, dp_rank, dp_size)
    scored = valid_bytes[: (len(valid_bytes) - 1) // d.seq_len * d.seq_len + 1]
    gzip_bpb = gzip_bits_per_byte(scored[1:])
    if console:
        if train:
            console.print(f"data: {len(train_files)} train files ({len(train_bytes):,} bytes), "
                          f"{len(valid_files)} valid files ({len(valid_bytes):,} bytes)")
        else:
            console.print(f"data: {len(valid_files)} valid files ({len(valid_bytes):,} bytes)")
        console.print(f"reference: gzip -9 on the {len(scored) - 1:,} validation bytes: "
                      f"{gzip_bpb:.3f} bits/byte")

    # Model: the same initial bits on every layout (built on meta, parallelised, then
    # materialised from draws seeded by (seed, parameter name)).
    gpt_config = gpt_config_of(config)
    torch.manual_seed(config.trainer.seed)  # the rest of the setup's randomness
    pipe = None
    if gangs.pp.size > 1:
        pipe = build_pipelined_model(gpt_config, gangs, config.trainer.seed,
                                     num_microbatches=config.trainer.num_accumulate,
                                     schedule=g.pp_schedule, boundaries=g.pp_boundaries,
                                     data_parallel=config.trainer.data_parallel)
        model = pipe.model
        valid_unit: Any = PipelineLMEvalUnit(pipe, bytes_per_token=1)
    else:
        model = build_model(gpt_config, gangs, config.trainer.data_parallel,
                            config.trainer.seed)
        if gangs.cp.size > 1:  # attention over the whole row, each rank holding a slice
            GPT_SPEC.attend_over(model, gangs.cp.as_process_group())
        valid_unit = CausalLMEvalUnit(model, bytes_per_token=1)
    if console:
        console.print(f"model: {num_parameters(model):,} parameters on this rank, "
                      f"{asdict(gpt_config)}")
    return _Setup(gangs, console, model, [valid_unit], [valid_reader], gzip_bpb, reader,
                  flops_per_token(gpt_config), pipe)


def main(config: LMConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    m = config.model
    optimizer = config.optimizer.build(s.model)
    # Its own length: extending a run keeps the rates of the steps already taken.
    scheduler = warmup_cosine(optimizer, config.lr_scheduler, config.trainer.max_num_steps)
    unit: Any = (PipelineLMUnit(s.pipeline) if s.pipeline is not None else
                 CausalLMUnit(s.model, bytes_per_token=1,
                              moe_aux_loss_weight=m.moe_aux_loss_weight,
                              flops_per_target=s.flops_per_token))
    trainer = config.trainer.build(
        unit,
        s.reader, optimizer, output_dir=output_dir,
        gangs=s.gangs, lr_scheduler=scheduler,
        valid_units=s.valid_units, valid_data_readers=s.valid_readers, resume=resume,
        run_config=config.model_dump(mode="json"),  # gangs.fault_tolerance: the shell's
    )
    result = trainer.run()
    if s.console:
        _summary(s.console, result, output_dir, s.gzip_bpb)
    s.gangs.close()
    return 0


def eval_main(config: LMConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: validate a checkpoint of ``output_dir`` (see `gangtrain.app.evaluate`)."""
    s = _setup(config, train=False)
    values = evaluate(s.valid_units, s.valid_readers, output_dir=output_dir, gangs=s.gangs,
                      checkpoint=checkpoint, console=s.console)
    if s.console:
        bpb = values["valid/bits_per_byte"]
        verdict = "beats" if bpb < s.gzip_bpb else "does not beat"
        s.console.print(f"valid bits/byte: {bpb:.4f} ({verdict} gzip -9: {s.gzip_bpb:.4f})")
    s.gangs.close()
    return 0


def gpt_config_of(config: LMConfig) -> GPTConfig:
    """The GPT the recipe's `model` section (and `data.seq_len`) describes."""
    m = config.model
    return GPTConfig(seq_len=config.data.seq_len, dim=m.dim, num_layers=m.num_layers,
                     num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, dropout=m.dropout,
                     num_experts=m.num_experts, top_k=m.top_k, tie_embeddings=m.tie_embeddings)


def check_pp_cp_config(config: LMConfig) -> None:
    """The settings the GPT cannot take on the asked layout, by name (its spec's refusals)."""
    GPT_SPEC.check_layout(gpt_config_of(config),
                          LayoutSizes.of(config.gangs, config.data.seq_len))


def _summary(console: Console, result, output_dir: Path, gzip_bpb: float) -> None:
    console.print(f"stopped after step {result.num_steps}: {result.stop_reason}")
    if result.best_score is not None:
        verdict = "beats" if result.best_score < gzip_bpb else "does not beat"
        console.print(f"best valid bits/byte: {result.best_score:.4f} at step "
                      f"{result.best_step} ({verdict} gzip -9: {gzip_bpb:.4f})")
    if result.best_checkpoint is not None:
        console.print(f"best checkpoint: {result.best_checkpoint}")
    console.print(f"curves: tensorboard --logdir {RunDir(output_dir).tensorboard}")
