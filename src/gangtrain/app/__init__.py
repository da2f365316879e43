"""The recipes' application shell, above the trainer and the model families: configs (YAML,
presets, `--set`, `TrainerConfig`), the command line, evaluate-only, and their messages."""

from gangtrain.app.config.callbacks import CallbackConfig
from gangtrain.app.config.trainer_config import TrainerConfig
from gangtrain.app.evaluate import evaluate

__all__ = ["CallbackConfig", "TrainerConfig", "evaluate"]
