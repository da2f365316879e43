"""The run directory's names: the one module that spells them.

    OUTPUT_DIR/
      config.yaml              the newest config of the run (the recipe command line)
      config_history/NNN.yaml  each config the directory started with
      checkpoints/step_N/      the checkpoints (`trainer.checkpoint`); a HF model's keep its
                               config and tokenizer in step_N/hf/
      checkpoints/best_model.safetensors   the best one's weights at the end of a run
      checkpoints/last, best   the newest and best step: symlinks where the file system
                               has them, else text files naming the step directory
      models/step_N/           model-only saves: model.safetensors, or a HF model's files
      metrics/<section>.jsonl  the metrics (`trainer.observe.recorders`)
      tb/, wandb/              TensorBoard and W&B files
      hf/                      the best checkpoint as a HF model directory (HF models)
      adapter/                 its LoRA adapters in peft's format (a run with adapters)
      .hf.tmp-PID, .hf.old-PID an export being written or replaced (an interrupted one's
                               are removed by the next export once PID is gone)
      failures/rank_R.txt      why a rank failed
      failures/noticed_by_rank_R.txt   a rank whose collective failed: which peer stopped
      profile/                 profiler traces

Everything else builds paths from `RunDir` and `step_dir_name` / `parse_step_dir`, so a
name changes in one place. Imports nothing of ours: every part of the trainer may use it.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
"""The run's config: `OUTPUT_DIR/config.yaml`, and beside each checkpoint `step_N/config.yaml`."""
BEST_MODEL = "best_model.safetensors"
"""The best checkpoint's weights, under `checkpoints/`."""
ADAPTER_DIR = "adapter"
"""The best checkpoint's LoRA adapters in peft's format, beside `hf/`."""
MODEL_FILE = "model.safetensors"
"""A model-only save's weights: `models/step_N/model.safetensors`."""
HF_FILES = "hf"
"""The subdirectory of a step directory that holds a HF model's config and tokenizer."""

_STEP_PREFIX = "step_"
_STEP_RE = re.compile(rf"^{_STEP_PREFIX}(\d+)$")


def step_dir_name(step_nr: int) -> str:
    """`step_N`: the name of step N's checkpoint directory."""
    return f"{_STEP_PREFIX}{step_nr}"


def parse_step_dir(name: str) -> int | None:
    """N of a `step_N` name; None for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def parse_checkpoint_choice(choice: str | int) -> str | int:
    """``"best"``, ``"last"``, or the step number of ``"step_N"`` / ``"N"`` / ``N``; a
    `ValueError` saying what is allowed otherwise."""
    if isinstance(choice, int) and not isinstance(choice, bool):
        if choice < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {choice}")
        return choice
    text = str(choice).strip()
    if text in ("best", "last"):
        return text
    step_nr = int(text) if text.isascii() and text.isdigit() else parse_step_dir(text)
    if step_nr is None:
        raise ValueError(f"checkpoint must be 'best', 'last' or 'step_N', got {choice!r}")
    return step_nr


class RunDir:
    """The paths of one run's files under `path` (the output directory); nothing is created."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def models(self) -> Path:
        """The model-only saves (`model_checkpoint_every_n_steps`)."""
        return self.path / "models"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def hf(self) -> Path:
        """The best checkpoint exported as a HF model directory."""
        return self.path / "hf"

    @property
    def adapter(self) -> Path:
        """The best checkpoint's LoRA adapters in peft's format."""
        return self.path / ADAPTER_DIR

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def config_history(self) -> Path:
        return self.path / "config_history"

    @property
    def failures(self) -> Path:
        return self.path / "failures"

    @property
    def profile(self) -> Path:
        return self.path / "profile"

    @property
    def rollouts(self) -> Path:
        return self.path / "rollouts"

    def rollout_file(self, step_nr: int) -> Path:
        """`rollouts/step_N.jsonl`: an online-RL unit's completions of step N."""
        return self.rollouts / f"{step_dir_name(step_nr)}.jsonl"

    def step_dir(self, step_nr: int) -> Path:
        """`checkpoints/step_N`."""
        return self.checkpoints / step_dir_name(step_nr)

    def of_a_run(self) -> tuple[Path, ...]:
        """What a run leaves that another run starting over here would mix with its own
        (deleted by `--overwrite`)."""
        return (self.checkpoints, self.models, self.metrics, self.tensorboard, self.wandb,
                self.config_history, self.rollouts)
