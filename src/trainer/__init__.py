"""The model-agnostic training loop and its services."""

from trainer.callbacks import Callback
from trainer.config import TrainerConfig
from trainer.errors import NonFiniteLossError, UserError
from trainer.result import TrainResult
from trainer.trainer import Trainer

__all__ = ["Callback", "NonFiniteLossError", "TrainResult", "Trainer", "TrainerConfig", "UserError"]
