"""The post-training assembly: what every objective shares, built once per run.

    a = assemble(objective, config, train=True)
    # a.spec: the family's spec, looked up once and handed to whatever needs it
    # a.tokenizer: as used (the config's chat template and end token applied)
    # a.gangs, a.console (rank 0), a.policy (an HFLayout), a.reference, a.stop_ids
    # a.model_files: what the Trainer keeps beside the weights (step_N/hf/, OUT/hf/)

In order: the objective's refusals and the layout against the model, before any process
group exists; the tokenizer; the gangs; the data (rank 0 first, the others from its cache;
a mistake on rank 0 raised on every rank); the policy and its reference; the units.
`train`, `evaluate_only` and `check_inputs` are the three entry points a recipe's command
line calls (`recipe_cli`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from gangs import Gangs, rank0_first
from gangtrain.app.cli import recipe_gangs, run_recipe
from gangtrain.app.parameter_counts import parameter_line
from gangtrain.app.pretrained import (
    evaluate_and_close,
    load_layout_of,
    load_tokenizer,
    report_run,
)
from gangtrain.models.hf.layout import HFLayout
from gangtrain.models.hf.load import load_pretrained
from gangtrain.models.hf.spec import HFSpec, spec_for
from gangtrain.models.hf.vision import is_vlm, processor_as_used
from gangtrain.posttrain.objective import Objective
from trainer.observe.console_log import configure_logging

__all__ = ["Assembly", "assemble", "check_inputs", "entry_points", "evaluate_only", "recipe_cli",
           "stop_ids", "train"]


@dataclass
class Assembly:
    """One run's shared parts (see the module docstring)."""

    config: Any
    spec: HFSpec
    hf_config: Any
    tokenizer: Any
    gangs: Gangs
    console: Console | None
    policy: HFLayout | None = None
    reference: Any = None
    output_dir: Path | None = None
    processor: Any = None
    """A vision-language model's processor as used (its tokenizer the run's), else None."""

    @property
    def model(self) -> nn.Module:
        assert self.policy is not None
        return self.policy.model

    @property
    def pad_id(self) -> int:
        t = self.tokenizer
        return t.pad_token_id if t.pad_token_id is not None else t.eos_token_id

    @property
    def stop_ids(self) -> list[int]:
        return stop_ids(self.config.model.path, self.tokenizer)

    @property
    def model_files(self) -> Any:
        return self.spec.model_files(self.processor or self.tokenizer)

    def print(self, line: str) -> None:
        if self.console is not None:
            self.console.print(line)

    def load_layout(self, **options: Any) -> HFLayout:
        """The pretrained model under the config's whole layout (TP, PP, CP, DP), with its
        units (`gangtrain.app.pretrained.load_layout_of`); `options`: more of
        `load_pretrained`'s."""
        return load_layout_of(self.config, self.gangs, spec=self.spec, **options)

    def frozen_copy(self) -> nn.Module:
        """The pretrained model again, frozen by its user: laid out like the policy (TP by
        its plan, FSDP2-sharded under trainer.data_parallel=fsdp, whole under DDP)."""
        c = self.config
        sharded = "fsdp" if c.trainer.data_parallel == "fsdp" else None
        return load_pretrained(c.model.path, self.gangs, data_parallel=sharded, spec=self.spec)


def stop_ids(path: str, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: generation_config.json's, and the tokenizer's."""
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def tokenizer_as_used(objective: Objective, config: Any) -> Any:
    return load_tokenizer(config.model.path, objective.chat_template(config),
                          objective.eos_token(config))


def assemble(objective: Objective, config: Any, train: bool, output_dir: Path
             ) -> tuple[Assembly, Any]:
    """(the assembly with its policy and reference, this rank's data); see the module
    docstring for the order."""
    configure_logging()
    hf_config = objective.check(config)
    tokenizer = tokenizer_as_used(objective, config)
    g = config.gangs
    gangs, console = recipe_gangs(g.timeout_s, g.tp_size, g.ep_size, g.dp_shard_size,
                                  pp_size=g.pp_size, cp_size=g.cp_size)
    a = Assembly(config, spec_for(hf_config), hf_config, tokenizer, gangs, console,
                 output_dir=output_dir)
    if is_vlm(hf_config):  # step_N/hf/ and OUT/hf/ keep the processor, AutoProcessor loads
        a.processor = processor_as_used(config.model.path, tokenizer)
    data = rank0_first(gangs.root, lambda: objective.read_data(
        config, tokenizer, gangs.dp.rank, gangs.dp.size, train))
    for line in getattr(data, "summary", []):
        a.print(line if line.startswith("data") else f"data {line}")
    objective.check_tokenizer(tokenizer, hf_config, config.model.path)
    a.policy = objective.load_policy(config, a)
    a.reference = objective.load_reference(config, a)
    stages = " (this rank: its pipeline stages)" if gangs.pp.size > 1 else ""
    a.print(f"model: {config.model.path}, {parameter_line(a.model)}{stages}"
            f"{objective.describe(config, a)}")
    return a, data


def train(objective: Objective, config: Any, output_dir: Path, resume: bool) -> int:
    """A training run: the assembly, the objective's parts, the Trainer, the report."""
    a, data = assemble(objective, config, train=True, output_dir=output_dir)
    parts = objective.build(config, a, data, train=True)
    optimizer = config.optimizer.build(a.model)
    trainer_config = config.trainer.model_copy(update=parts.trainer_updates) \
        if parts.trainer_updates else config.trainer
    trainer = trainer_config.build(
        parts.train_unit, parts.train_reader, optimizer, output_dir=output_dir, gangs=a.gangs,
        lr_scheduler=objective.lr_scheduler(config, optimizer, parts),
        valid_units=parts.valid_units, valid_data_readers=parts.valid_readers, resume=resume,
        run_config=config.model_dump(mode="json"), model_files=a.model_files,
        **({"stateful": parts.stateful} if parts.stateful else {}))
    result = trainer.run()
    report_run(a.console, result, config.trainer.score_metric, output_dir,
               a.processor or a.tokenizer)
    a.gangs.close()
    return 0


def evaluate_only(objective: Objective, config: Any, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: the objective's valid units on a checkpoint of ``output_dir``."""
    objective.check_evaluation(config)
    a, data = assemble(objective, config, train=False, output_dir=output_dir)
    parts = objective.build(config, a, data, train=False)
    evaluate_and_close(parts.valid_units, parts.valid_readers, output_dir=output_dir,
                       gangs=a.gangs, checkpoint=checkpoint, console=a.console)
    return 0


def check_inputs(objective: Objective, config: Any) -> None:
    """Every input a run needs, opened and checked before anything is written: the model
    directory and layout, the tokenizer as used, the objective's own inputs."""
    objective.check(config)
    tokenizer = tokenizer_as_used(objective, config)
    objective.check_inputs(config, tokenizer)


def entry_points(objective: Objective) -> tuple[Any, Any, Any]:
    """(main, eval_main, check_inputs) of `objective`: what a recipe module exports."""
    return (partial(train, objective), partial(evaluate_only, objective),
            partial(check_inputs, objective))


def recipe_cli(objective: Objective, presets: dict[str, Any], argv: Sequence[str] | None,
               prog: str, config_type: type[Any] | None = None) -> int:
    """`python -m recipes.NAME ARGS` for `objective`: the shared command line
    (`gangtrain.app.cli.run_recipe`) over the three entry points; returns the exit code.
    `config_type`: the objective's own unless given (`recipes.posttrain` adds a key)."""
    return run_recipe(config_type or objective.config_type, presets, partial(train, objective),
                      argv,
                      prog=prog, default_preset="default",
                      resume_guard=objective.resume_guard,
                      eval_main=partial(evaluate_only, objective),
                      check_inputs=partial(check_inputs, objective))
