"""Assemble the classify recipe: gangs, data, MLP, stock classification units, trainer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from gangs import Gangs
from gangtrain.app.cli import recipe_gangs
from gangtrain.app.config.early_stopper import build_early_stopper
from gangtrain.app.evaluate import evaluate
from gangtrain.parallel import data_parallel
from recipes.classify.config import ClassifyConfig
from recipes.classify.data import ShardedBatchReader, eval_batches, make_spirals, split
from trainer.observe.console_log import configure_logging
from trainer.result import TrainResult
from units.classification import ClassificationEvalUnit, ClassificationUnit


class MLP(nn.Module):
    """``num_layers`` hidden layers of ``Linear -> GELU (-> Dropout)``, then the logits."""

    def __init__(self, in_dim: int, hidden_dim: int, num_layers: int, num_classes: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers):
            layers += [nn.Linear(dim, hidden_dim), nn.GELU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            dim = hidden_dim
        layers.append(nn.Linear(dim, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


@dataclass
class _Setup:
    """What training and evaluation share: gangs, the (wrapped) model, validation."""

    gangs: Gangs
    console: Console | None
    model: nn.Module
    valid_units: list[ClassificationEvalUnit]
    valid_readers: list[Iterable[Any]]
    reader: ShardedBatchReader


def _setup(config: ClassifyConfig) -> _Setup:
    configure_logging()  # on rank 0 only: every line once
    gangs, console = recipe_gangs(config.gangs.timeout_s)
    dp_rank, dp_size = gangs.dp.rank, gangs.dp.size

    # Data: the same samples on every rank; each DP rank takes its slice of every batch.
    d = config.data
    samples = make_spirals(d.train_size + d.valid_size, d.num_classes, d.dim, d.turns,
                           d.noise, d.label_noise, seed=d.seed)
    train, valid = split(samples, d.valid_size)
    reader = ShardedBatchReader(train, d.batch_size, dp_rank, dp_size, seed=d.shuffle_seed)
    valid_reader = eval_batches(valid, d.valid_batch_size, dp_rank, dp_size)
    if console:
        console.print(f"data: {d.num_classes} spirals in {d.dim}-D, {d.train_size:,} train / "
                      f"{d.valid_size:,} valid samples, {d.label_noise:.0%} label noise")

    # Model: the same initial weights on every rank, then wrapped for data parallelism.
    m = config.model
    torch.manual_seed(config.trainer.seed)
    model = MLP(d.dim, m.hidden_dim, m.num_layers, d.num_classes, m.dropout).to(gangs.device)
    model = data_parallel(model, gangs, config.trainer.data_parallel)
    if console:
        num_params = sum(p.numel() for p in model.parameters())
        console.print(f"model: MLP {d.dim} -> {m.num_layers} x {m.hidden_dim} -> "
                      f"{d.num_classes}, {num_params:,} parameters")
    return _Setup(gangs, console, model, [ClassificationEvalUnit(model)], [valid_reader],
                  reader)


def main(config: ClassifyConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config)
    optimizer = config.optimizer.build(s.model)
    trainer = config.trainer.build(
        ClassificationUnit(s.model), s.reader, optimizer, output_dir=output_dir,
        gangs=s.gangs, valid_units=s.valid_units, valid_data_readers=s.valid_readers,
        resume=resume, run_config=config.model_dump(mode="json"),
    )
    result = trainer.run()
    if s.console:
        _summary(s.console, result, config)
    s.gangs.close()
    return 0


def eval_main(config: ClassifyConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: validate a checkpoint of ``output_dir`` (see `gangtrain.app.evaluate`)."""
    s = _setup(config)
    evaluate(s.valid_units, s.valid_readers, output_dir=output_dir, gangs=s.gangs,
             checkpoint=checkpoint, console=s.console)
    s.gangs.close()
    return 0


def _summary(console: Console, result: TrainResult, config: ClassifyConfig) -> None:
    t = config.trainer
    reason = result.stop_reason
    if reason == "early_stop" and t.early_stopper is not None:
        stopper = build_early_stopper(t.early_stopper, t.lower_better)
        reason = f"early_stop by {stopper!r} on {t.score_metric}"
    console.print(f"stopped after step {result.num_steps}: {reason}")
    if result.best_score is not None:
        console.print(f"best {t.score_metric}: {result.best_score:.4f} at step "
                      f"{result.best_step}")
    if result.best_checkpoint is not None:
        console.print(f"best checkpoint: {result.best_checkpoint}")
