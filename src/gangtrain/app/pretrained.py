"""What the recipes that train a pretrained Hugging Face model share (`recipes.sft`,
`recipes.finetune`, `recipes.preference`), each written once: the tokenizer with the
config's chat template and end token, the layout checked against the model by its family's
spec before anything is built, the model loaded under the config's layout, and the
evaluate-only entry point's tail.

A recipe config here is duck-typed: `model.path`, `model.activation_checkpointing`,
`data.seq_len`, `gangs` (`config.sections.GangsSection`), `trainer` (`TrainerConfig`) and
`lora` (`config.sections.LoraSection`), as those recipes' configs have them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from gangs import Gangs
from gangtrain.app.evaluate import evaluate
from gangtrain.data.chat import CHATML_TEMPLATE, CHATML_TOKENS
from gangtrain.models.hf.hf_config import check_model_dir
from gangtrain.models.hf.hf_config import load_tokenizer as load_model_tokenizer
from gangtrain.models.hf.layout import HFLayout, load_layout
from gangtrain.models.hf.spec import spec_for
from gangtrain.parallel.spec import LayoutSizes
from trainer.errors import UserError
from trainer.result import TrainResult
from trainer.run_dir import RunDir

__all__ = ["check_layout", "evaluate_and_close", "load_layout_of", "load_tokenizer",
           "report_run"]


def load_tokenizer(path: str, chat_template: str | None = None,
                   eos_token: str | None = None) -> Any:
    """The tokenizer of the model directory `path`, with `chat_template` (a Jinja file, or
    "chatml" for the built-in ChatML template) in place of its own and `eos_token` (one of
    its tokens) as its end token; it must have a pad or an end token to pad rows with."""
    tokenizer = load_model_tokenizer(path)
    if chat_template == "chatml" and not Path(chat_template).is_file():
        missing = [t for t in CHATML_TOKENS if t not in tokenizer.get_vocab()]
        if missing:
            raise UserError(f"config 'data.chat_template=chatml': the tokenizer of "
                            f"'{path}' has no {' or '.join(missing)} token: give a template "
                            "of its own tokens (a Jinja file)")
        tokenizer.chat_template = CHATML_TEMPLATE
    elif chat_template is not None:
        if not Path(chat_template).is_file():
            raise UserError(f"config 'data.chat_template': no such file: '{chat_template}' "
                            "(a Jinja file, or chatml for the built-in ChatML template)")
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    if eos_token is not None:
        if eos_token not in tokenizer.get_vocab():
            raise UserError(f"config 'data.eos_token': {eos_token!r} is not a token of the "
                            f"tokenizer of '{path}': give one of its tokens (adding one would "
                            "grow the model's vocabulary)")
        tokenizer.eos_token = eos_token
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of '{path}' has neither a pad nor an end token to "
                        "pad rows with")
    return tokenizer


def check_layout(config: Any) -> Any:
    """The model directory's `PretrainedConfig`, after the checks of the directory (as a
    whole), of the gangs' sizes between themselves (`GangsSection.check`) and of the layout
    against the model (its family's spec, `ModelSpec.check_layout`): a `UserError` naming
    the first setting that does not fit, before any process group or model exists."""
    hf_config = check_model_dir(config.model.path, config.data.seq_len)
    config.gangs.check(config.trainer.data_parallel)
    sizes = LayoutSizes.of(config.gangs, config.data.seq_len,
                           config.model.activation_checkpointing)
    spec_for(hf_config).check_layout(hf_config, sizes)
    return hf_config


def load_layout_of(config: Any, gangs: Gangs, **options: Any) -> HFLayout:
    """The pretrained model of `model.path` as this rank holds it under the config's layout,
    with its units (`models.hf.layout.load_layout`): the trainer's data parallelism and
    micro-batches, the gangs' pipeline schedule, activation checkpointing per block, LoRA
    adapters when `lora.r` is set; `options`: more of `load_pretrained`'s (e.g. `dtype`)."""
    return load_layout(config.model.path, gangs,
                       data_parallel=config.trainer.data_parallel,
                       num_accumulate=config.trainer.num_accumulate,
                       pp_schedule=config.gangs.pp_schedule,
                       pp_boundaries=config.gangs.pp_boundaries,
                       activation_checkpointing=config.model.activation_checkpointing,
                       **{**config.lora.load_options(config.trainer.seed), **options})


def evaluate_and_close(valid_units: Sequence[Any], valid_readers: Sequence[Iterable[Any]], *,
                       output_dir: Path, gangs: Gangs, checkpoint: str,
                       console: Console | None) -> dict[str, float]:
    """``--eval-only``'s tail: validate checkpoint `checkpoint` of `output_dir`
    (`gangtrain.app.evaluate`), then close the gangs; the metrics."""
    values = evaluate(valid_units, valid_readers, output_dir=output_dir, gangs=gangs,
                      checkpoint=checkpoint, console=console)
    gangs.close()
    return values


def report_run(console: Console | None, result: TrainResult, score_metric: str | None,
               output_dir: Path, tokenizer: Any = None) -> None:
    """Rank 0 (`console` given), at the end of a run: the tokenizer as the run used it (chat
    template included) beside the exported model, then why the run stopped, its best score
    and where the best checkpoint went (`OUTPUT_DIR/hf/`, `OUTPUT_DIR/adapter/`)."""
    if console is None:
        return
    run_dir = RunDir(output_dir)
    if tokenizer is not None and run_dir.hf.is_dir():
        tokenizer.save_pretrained(run_dir.hf)
    console.print(f"stopped after step {result.num_steps}: {result.stop_reason}")
    if result.best_score is not None:
        console.print(f"best {score_metric}: {result.best_score:.4f} at step "
                      f"{result.best_step}")
    if result.best_checkpoint is not None and run_dir.hf.is_dir():
        console.print(f"exported {result.best_checkpoint} as a Hugging Face model: "
                      f"{run_dir.hf}")
    if result.best_checkpoint is not None and run_dir.adapter.is_dir():
        console.print(f"its LoRA adapters in peft's format: {run_dir.adapter}")
