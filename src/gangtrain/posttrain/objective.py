"""An objective: what one kind of post-training adds to the assembly (`assembly`), by name.

The assembly builds what every objective shares once, over the model's family spec: the
tokenizer as used, the gangs, the policy under the config's layout, the model files the
Trainer keeps. An objective adds the rest: its config (`config_type`), the layouts it refuses,
its data, its reference, its units. Adding an objective of a new shape is one file: a
subclass with a `name`, registered in `OBJECTIVES` (or named by import path,
``"pkg.mod:MyObjective"``, from a user's own package), and a recipe module of a few lines.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch.optim import Optimizer

from gangtrain.app.config.import_path import import_object
from gangtrain.app.pretrained import check_layout
from gangtrain.models.hf.hf_config import check_tokenizer_fits
from trainer.errors import UserError
from trainer.lr_schedules import warmup_cosine

if TYPE_CHECKING:
    from gangtrain.models.hf.layout import HFLayout
    from gangtrain.posttrain.assembly import Assembly

__all__ = ["OBJECTIVES", "Objective", "Parts", "data_parallel_only", "objective_named"]


@dataclass
class Parts:
    """What an objective hands the Trainer: its units and readers (None/empty when only
    evaluating), state of its own for the checkpoints, Trainer settings it changes."""

    train_unit: Any | None
    train_reader: Iterable[Any] | None
    valid_units: list[Any]
    valid_readers: list[Iterable[Any]]
    stateful: dict[str, Any] = field(default_factory=dict)
    trainer_updates: dict[str, Any] = field(default_factory=dict)
    lr_schedule_length: int | None = None
    """Steps of the learning-rate schedule where the objective knows them (an epoch's)."""


class Objective:
    """One kind of post-training. Subclasses set `name`, `config_type` (a pydantic section
    with at least `model.path`, `data`, `optimizer`, `lr_scheduler`, `trainer`, `gangs` and
    `lora`) and `resume_guard`, and override `read_data` and `build`; the other methods
    have the defaults most objectives want."""

    name: ClassVar[str] = ""
    config_type: ClassVar[type[Any]]
    resume_guard: ClassVar[tuple[str, ...]] = ()
    presets: ClassVar[dict[str, Any]] = {"default": {"_doc": "the objective's defaults"}}
    """`--preset` choices under `recipes.posttrain` (a recipe module keeps its own)."""

    def check(self, config: Any) -> Any:
        """The model's HF config, after refusing by name what does not fit: the settings
        between themselves, the layout against the model (its family's spec). Runs before
        any process group or model exists."""
        return check_layout(config)

    def check_evaluation(self, config: Any) -> None:
        """What `--eval-only` needs beyond `check` (e.g. held-out data)."""

    def chat_template(self, config: Any) -> str | None:
        """The chat template that replaces the tokenizer's own (a file or "chatml")."""
        return getattr(config.data, "chat_template", None)

    def eos_token(self, config: Any) -> str | None:
        """A token of the vocabulary to use as the end token."""
        return getattr(config.data, "eos_token", None)

    def check_tokenizer(self, tokenizer: Any, hf_config: Any, path: str) -> None:
        """A `UserError` when the tokenizer has more tokens than the model's embedding."""
        check_tokenizer_fits(tokenizer, hf_config, path)

    def read_data(self, config: Any, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> Any:
        """This DP rank's data (read on rank 0 first, then the others from its cache);
        anything with a `summary` (lines printed as ``data ...``)."""
        raise NotImplementedError

    def load_policy(self, config: Any, a: Assembly) -> HFLayout:
        """The policy as this rank holds it under the config's layout."""
        return a.load_layout()

    def load_reference(self, config: Any, a: Assembly) -> Any:
        """The frozen reference, or None (the default: none needed)."""
        return None

    def describe(self, config: Any, a: Assembly) -> str:
        """What the model line says after the parameter counts."""
        return ""

    def build(self, config: Any, a: Assembly, data: Any, train: bool) -> Parts:
        """The units and readers over the assembly and this rank's data."""
        raise NotImplementedError

    def lr_scheduler(self, config: Any, optimizer: Optimizer, parts: Parts) -> Any:
        """Warm-up then cosine decay over trainer.max_num_steps (lr_scheduler section)."""
        return warmup_cosine(optimizer, config.lr_scheduler, config.trainer.max_num_steps)

    def check_inputs(self, config: Any, tokenizer: Any) -> None:
        """Open every input before anything is written (rank 0): by default the data."""
        self.read_data(config, tokenizer, 0, 1, True)


def data_parallel_only(config: Any, recipe: str, why: str) -> None:
    """A `UserError` naming the first gang other than data parallelism that `config` sets
    above 1 (for an objective whose step `why` says cannot run there)."""
    for name in ("tp_size", "pp_size", "cp_size", "ep_size"):
        size = getattr(config.gangs, name)
        if size > 1:
            raise UserError(f"config 'gangs.{name}={size}': {recipe} runs data parallelism "
                            f"only (FSDP2, HSDP, DDP): {why}; set gangs.{name}=1")


OBJECTIVES: dict[str, str] = {
    "sft": "gangtrain.posttrain.objectives.sft:SFTObjective",
    "finetune": "gangtrain.posttrain.objectives.finetune:FinetuneObjective",
    "preference": "gangtrain.posttrain.objectives.preference:PreferenceObjective",
    "grpo": "gangtrain.posttrain.objectives.grpo:GRPOObjective",
    "reward": "gangtrain.posttrain.objectives.reward:RewardObjective",
    "distill": "gangtrain.posttrain.objectives.distill:DistillObjective",
}
"""The objectives by name: the class's import path, imported on first use."""


def objective_named(name: str) -> Objective:
    """The objective `name`: a registered one, or a user's ``"pkg.mod:Class"``."""
    if name in OBJECTIVES:
        module, _, attribute = OBJECTIVES[name].partition(":")
        cls = getattr(importlib.import_module(module), attribute)
    elif ":" in name:
        try:
            cls = import_object(name, "objective")
        except ValueError as error:  # not importable: named with the reason
            raise UserError(f"objective: {error}") from None
    else:
        raise UserError(f"objective '{name}': one of {', '.join(sorted(OBJECTIVES))}, or an "
                        "import path 'package.module:Class' of your own")
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise UserError(f"objective '{name}' is a {type(cls).__name__}, not a subclass of "
                        "gangtrain.posttrain.Objective")
    return cls()
