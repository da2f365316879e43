"""On-policy distillation (`recipes.distill`): the student (`model.path`) samples completions
of TRL's prompt-only records with the RL generator (`gangtrain.rl.generation`), the frozen
teacher (`teacher.path`, laid out like the student: FSDP2-sharded under FSDP2, whole under
DDP) scores them, and the loss is TRL's generalised JSD per completion token
(`units.distill`), summed and counted by completion tokens. With `loss.lmbda` below 1 a
share of micro-batches trains on the records' own ``completion`` instead (GKD).

The teacher's vocabulary must be the student's (the divergence compares whole next-token
distributions): a different ``vocab_size`` or token mapping is refused by name.

TRL's names map to: GKDConfig/DistillationConfig ``beta`` -> loss.beta (the same
convention), ``lmbda`` -> loss.lmbda, ``temperature`` -> generation.temperature (sampling)
and loss.temperature (the divergence: DistillationTrainer uses it for both, GKD's loss runs
at 1), ``max_new_tokens``/``max_completion_length`` -> generation.max_new_tokens,
``teacher_model_name_or_path`` -> teacher.path; ``seq_kd`` (teacher samples) is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt

from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig
from gangtrain.app.pretrained import check_layout
from gangtrain.data.chat import ChatEncoder, encode_prompt_completion
from gangtrain.data.global_batches import GlobalBatchReader, eval_rows
from gangtrain.data.prompts import PromptSet, read_prompts
from gangtrain.models.hf.hf_config import read_hf_config
from gangtrain.models.hf.load import load_pretrained
from gangtrain.posttrain.objective import Objective, Parts, data_parallel_only
from gangtrain.rl.generation import HFGenerator
from trainer.errors import UserError
from units.distill import DistillEvalUnit, DistillLoss, DistillUnit

__all__ = ["DistillConfig", "DistillObjective", "RESUME_GUARD"]


class ModelSection(Section):
    path: str | None = None
    """The student: a local Hugging Face model directory. Required."""
    activation_checkpointing: bool = False


class TeacherSection(Section):
    path: str | None = None
    """The teacher: a local Hugging Face model directory of the student's vocabulary.
    Required."""


class OptimizerSection(AdamWConfig):
    """AdamW with TRL's GKDConfig defaults (lr 5e-7 there; 1e-5 here, for small students)."""

    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class DataSection(Section):
    files: list[str] = []
    """Prompts: JSONL or JSON files, TRL's prompt-only forms (`prompt` text or messages),
    with a `completion` (same form) where loss.lmbda < 1. Required."""
    valid_files: list[str] = []
    """Held-out prompts: the student's greedy completions scored against the teacher
    (valid/kl, valid/loss); empty: no validation."""
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    batch_size: PositiveInt = 8
    """The GLOBAL micro-batch in prompts, across DP ranks."""
    valid_batch_size: PositiveInt = 16
    shuffle_seed: int = 0
    seq_len: PositiveInt = 1024
    """Prompt and completion tokens at most (checked against the model's context)."""


class GenerationSection(Section):
    max_new_tokens: PositiveInt = 128
    """TRL's max_new_tokens / max_completion_length."""
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)


class DistillConfig(Section):
    model: ModelSection = ModelSection()
    teacher: TeacherSection = TeacherSection()
    data: DataSection = DataSection()
    generation: GenerationSection = GenerationSection()
    loss: DistillLoss = DistillLoss()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection(warmup_steps=0)
    trainer: TrainerConfig = FINETUNING_TRAINER
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


RESUME_GUARD = ("model.path", "teacher.path", "data.files", "data.prompt_field",
                "data.completion_field", "data.batch_size", "data.shuffle_seed", "loss.beta",
                "loss.temperature", "loss.lmbda", *LoraSection.RESUME_GUARD)


@dataclass
class Examples:
    """Prompt ids with the record's completion ids (None without one)."""

    prompts: list[tuple[int, ...]]
    completions: list[tuple[int, ...] | None]


def examples(prompts: PromptSet, tokenizer: Any, field: str, name: str) -> Examples:
    """The prompts' ids and their records' own completions, encoded after the prompt as SFT
    encodes an answer (text: its tokens and the end token; messages: the chat template's
    assistant turn)."""
    chat = ChatEncoder(tokenizer, name) if prompts.conversational else None
    out: list[tuple[int, ...] | None] = []
    for p in prompts.prompts:
        completion = p.columns.get(field)
        if completion is None:
            out.append(None)
        elif chat is not None:
            ids, trained = chat([*p.prompt, *completion], train_from=len(p.prompt))
            out.append(tuple(ids[len(p.ids):]) if 1 in trained else None)
        else:
            ids, trained = encode_prompt_completion(tokenizer, p.prompt, completion)
            out.append(tuple(ids[trained.index(1):]))
    return Examples([p.ids for p in prompts.prompts], out)


class PromptReader(GlobalBatchReader[dict[str, Any]]):
    """Training micro-batches of prompts (and their completions) across DP ranks, shuffled
    each epoch, resumable; ``indices`` the examples' numbers (their sampling seeds')."""

    def __init__(self, data: Examples, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        self.data = data
        super().__init__(len(data.prompts), batch_size, dp_rank, dp_size, seed)

    def make_batch(self, indices: torch.Tensor) -> dict[str, Any]:
        rows = indices.tolist()
        return {"prompts": [self.data.prompts[i] for i in rows],
                "completions": [self.data.completions[i] for i in rows], "indices": rows}


class PromptEvalBatches:
    """Held-out prompts in order, dealt to DP ranks (`eval_rows`)."""

    def __init__(self, data: Examples, batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.data = data
        self._slices = eval_rows(len(data.prompts), batch_size, dp_rank, dp_size,
                                 no_empty_rank=True)

    def __len__(self) -> int:
        return len(self._slices)

    def __iter__(self) -> Any:
        for rows in self._slices:
            indices = list(range(rows.start, rows.stop))
            yield {"prompts": [self.data.prompts[i] for i in indices], "indices": indices}


@dataclass
class DistillData:
    train: PromptReader | None
    valid: PromptEvalBatches | None
    summary: list[str]


def check_vocabularies(student: str, teacher: str) -> None:
    """A `UserError` naming both settings when the teacher's vocabulary is not the
    student's: another size, or the same size with tokens mapped to other ids."""
    sizes = [read_hf_config(Path(path)).get_text_config().vocab_size
             for path in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise UserError(f"config 'teacher.path': {teacher} has vocab_size {sizes[1]} and "
                        f"model.path {student} {sizes[0]}: distillation compares whole "
                        "next-token distributions, which needs one vocabulary; use a teacher "
                        "of the student's tokenizer")
    from transformers import AutoTokenizer

    try:
        vocabularies = [AutoTokenizer.from_pretrained(path).get_vocab()
                        for path in (student, teacher)]
    except (OSError, ValueError):  # a directory without tokenizer files: sizes only
        return
    if vocabularies[0] != vocabularies[1]:
        raise UserError(f"config 'teacher.path': the tokenizer of {teacher} maps tokens to "
                        f"other ids than the one of model.path {student}: distillation needs "
                        "one vocabulary")


class DistillObjective(Objective):
    """`distill`: the student samples, the frozen teacher scores; data parallelism only."""

    name = "distill"
    config_type = DistillConfig
    resume_guard = RESUME_GUARD

    def check(self, config: DistillConfig) -> Any:
        data_parallel_only(config, "recipes.distill",
                           "the teacher and the generator are not split over other gangs")
        if config.teacher.path is None:
            raise UserError("config 'teacher.path' is not set: give the teacher's model "
                            "directory, e.g. --set teacher.path=DIR")
        hf_config = check_layout(config)
        check_vocabularies(str(config.model.path), config.teacher.path)
        return hf_config

    def read_data(self, config: DistillConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> DistillData:
        d = config.data
        room = d.seq_len - config.generation.max_new_tokens
        if room < 1:
            raise UserError(f"config 'generation.max_new_tokens={config.generation.max_new_tokens}'"
                            f" leaves no room for a prompt in data.seq_len={d.seq_len}")

        def read(files: list[str], setting: str) -> Examples:
            prompts = read_prompts(files, tokenizer, max_prompt_tokens=room,
                                   prompt_field=d.prompt_field, setting=setting)
            return examples(prompts, tokenizer, d.completion_field, f"'{config.model.path}'")

        reader = valid = None
        summary = []
        if train:
            if not d.files:
                raise UserError("config 'data.files' is empty: list the JSONL or JSON files "
                                "of prompts, e.g. --set 'data.files=[prompts.jsonl]'")
            data = read(list(d.files), "data.files")
            missing = sum(c is None for c in data.completions)
            if config.loss.lmbda < 1 and missing:
                raise UserError(f"config 'loss.lmbda={config.loss.lmbda}' trains a share on "
                                f"the records' own '{d.completion_field}', which {missing} of "
                                f"{len(data.prompts)} lack: give every record one, or set "
                                "loss.lmbda=1 (on-policy only)")
            reader = PromptReader(data, d.batch_size, dp_rank, dp_size, d.shuffle_seed)
            summary.append(f"train: {len(data.prompts):,} prompts")
        if d.valid_files:
            held = read(list(d.valid_files), "data.valid_files")
            valid = PromptEvalBatches(held, d.valid_batch_size, dp_rank, dp_size)
            summary.append(f"valid: {len(held.prompts):,} prompts")
        return DistillData(reader, valid, summary)

    def check_evaluation(self, config: DistillConfig) -> None:
        if not config.data.valid_files:
            raise UserError("--eval-only scores held-out prompts: set data.valid_files")

    def load_reference(self, config: DistillConfig, a: Any) -> Any:
        sharded = "fsdp" if config.trainer.data_parallel == "fsdp" else None
        teacher = load_pretrained(str(config.teacher.path), a.gangs, data_parallel=sharded)
        return teacher.requires_grad_(False).eval()

    def describe(self, config: DistillConfig, a: Any) -> str:
        c = config.loss
        return (f"; teacher {config.teacher.path}; beta {c.beta}, temperature "
                f"{c.temperature}, lmbda {c.lmbda}")

    def build(self, config: DistillConfig, a: Any, data: DistillData, train: bool) -> Parts:
        g = config.generation
        fsdp = config.trainer.data_parallel == "fsdp" and a.gangs.dp.size > 1

        def generator(temperature: float) -> HFGenerator:
            return HFGenerator(a.model, stop_ids=a.stop_ids, pad_id=a.pad_id,
                               max_new_tokens=g.max_new_tokens, temperature=temperature,
                               top_p=g.top_p if temperature else 1.0,
                               gang=a.gangs.dp if fsdp else None)

        common = (a.model, a.reference, config.loss)
        seed = config.trainer.seed or 0
        unit = DistillUnit(*common, generator(g.temperature), a.pad_id, seed) if train else None
        valid = [DistillEvalUnit(*common, generator(0.0), a.pad_id, seed)] \
            if data.valid is not None else []
        return Parts(unit, data.train, valid, [data.valid] if data.valid is not None else [])
