"""Fine-tuning on text (`recipes.finetune`): a local Hugging Face causal LM on text and JSONL
(`text`) documents, tokenised with the model's own tokenizer and packed into fixed windows
(`data.packing`); the stock causal-LM units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, PositiveInt
from torch import Tensor, nn

from gangs import Gangs
from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig
from gangtrain.app.pretrained import load_layout_of as load_pretrained_layout
from gangtrain.data import (
    WindowReader,
    pack_windows,
    read_documents,
    split_windows,
    tokenize_documents,
)
from gangtrain.data.finetune import eval_batches
from gangtrain.models.hf import hf_model_of
from gangtrain.models.hf.layout import HFLayout
from gangtrain.posttrain.objective import Objective, Parts
from trainer.errors import UserError

__all__ = ["RESUME_GUARD", "FinetuneConfig", "FinetuneObjective", "load_layout_of",
           "load_model"]

class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory: config.json, model.safetensors (or shards with
    an index) and the tokenizer files. Required."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less memory, about a
    third more compute."""


class DataSection(Section):
    files: list[str] = []
    """Text files (each file one document) and JSONL files (`.jsonl`: one JSON object a
    line, its `text_field` one document). Required."""
    text_field: str = "text"
    """The field of a JSONL record that holds its text."""
    seq_len: PositiveInt = 1024
    """Tokens per window: documents are tokenised, joined and cut into windows this long."""
    batch_size: PositiveInt = 32
    """The GLOBAL micro-batch: windows across all data-parallel ranks."""
    valid_batch_size: PositiveInt = 32
    valid_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of the windows held out for validation (at least one)."""
    split_seed: int = 0
    """Seed of which windows are held out: the same split on every rank and every run."""
    shuffle_seed: int = 0


class OptimizerSection(AdamWConfig):
    lr: float = Field(default=2e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.0, ge=0)


class FinetuneConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection()
    trainer: TrainerConfig = FINETUNING_TRAINER
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


# Settings a resumed run may not change: the model and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.text_field", "data.seq_len",
                "data.batch_size", "data.valid_fraction", "data.split_seed",
                "data.shuffle_seed", *LoraSection.RESUME_GUARD)


def load_model(config: FinetuneConfig, gangs: Gangs) -> nn.Module:
    """The pretrained model of `config.model.path`, ready for the Trainer (`load_layout_of`:
    the module to train, this rank's stages under pipeline parallelism)."""
    return load_layout_of(config, gangs).model


def load_layout_of(config: FinetuneConfig, gangs: Gangs, spec: Any = None) -> HFLayout:
    """The pretrained model as this rank holds it under the gangs' layout, with its units:
    built on meta, tensor-parallel by its own plan over `gangs.tp`, cut into pipeline stages
    or attending over the cp gang, wrapped over DP, each rank reading its slices of the
    weights; activation checkpointing per block if asked."""
    # Activation checkpointing goes on each block before the model is wrapped (DDP, FSDP2,
    # or FSDP2 for DDP x TP), in one process too.
    layout = load_pretrained_layout(config, gangs, spec=spec)
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
class Windows:
    """Every rank's windows: the same split on every rank, each its share."""

    train: WindowReader | None
    valid: list[Any]
    max_token: int
    summary: list[str]


class FinetuneObjective(Objective):
    """`finetune`: the causal-LM loss on every token of packed windows of text."""

    name = "finetune"
    config_type = FinetuneConfig
    resume_guard = RESUME_GUARD

    def chat_template(self, config: FinetuneConfig) -> str | None:
        return None

    def check_tokenizer(self, tokenizer: Any, hf_config: Any, path: str) -> None:
        """The tokens themselves are checked against the model (`build`)."""

    def read_data(self, config: FinetuneConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> Windows:
        d = config.data
        tokens: Tensor = tokenize_documents(read_documents(d.files, d.text_field), tokenizer)
        train_windows, valid_windows = split_windows(pack_windows(tokens, d.seq_len),
                                                     d.valid_fraction, d.split_seed,
                                                     d.batch_size)
        reader = (WindowReader(train_windows, d.batch_size, dp_rank, dp_size,
                               seed=d.shuffle_seed) if train else None)
        summary = [f"data: {len(d.files)} files, {tokens.numel():,} tokens: "
                   f"{len(train_windows):,} train / {len(valid_windows):,} valid windows of "
                   f"{d.seq_len} tokens"]
        return Windows(reader, eval_batches(valid_windows, d.valid_batch_size, dp_rank, dp_size),
                       int(tokens.max()) if tokens.numel() else -1, summary)

    def load_policy(self, config: FinetuneConfig, a: Any) -> HFLayout:
        return load_layout_of(config, a.gangs, a.spec)

    def build(self, config: FinetuneConfig, a: Any, data: Windows, train: bool) -> Parts:
        if data.max_token >= a.hf_config.vocab_size:
            raise UserError(f"config 'model.path': the tokenizer of '{config.model.path}' gives "
                            f"token {data.max_token}, beyond the model's vocab_size "
                            f"{a.hf_config.vocab_size}: the tokenizer files belong to another "
                            "model")
        model = a.policy.model
        num_params = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        flops = _flops_per_token(a.hf_config, num_params, trained, config.data.seq_len)
        unit = a.policy.train_unit(flops_per_target=flops) if train else None
        return Parts(unit, data.train, [a.policy.valid_unit()], [data.valid])

    def check_inputs(self, config: FinetuneConfig, tokenizer: Any) -> None:
        read_documents(config.data.files, config.data.text_field)


def _flops_per_token(hf_config: Any, num_params: int, trained: int, seq_len: int) -> float:
    """Training FLOPs per token for the published MFU: 6 N + 12 L d T (the LM recipe's
    convention, N counting every parameter here). A frozen parameter costs 4 (forward, and
    the gradient of its input in backward), not 6: it has no gradient of its own (LoRA)."""
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    width = getattr(hf_config, "hidden_size", 0) or 0
    return 4.0 * num_params + 2.0 * trained + 12.0 * layers * width * seq_len
