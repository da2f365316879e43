"""The model-agnostic training loop and its services."""

from trainer.callbacks import Callback, CallbackConfig, CallbackError
from trainer.config import TrainerConfig
from trainer.errors import NonFiniteLossError, UserError
from trainer.evaluate import evaluate
from trainer.global_batches import GlobalBatchReader
from trainer.result import TrainResult
from trainer.trainer import Trainer

__all__ = [
    "Callback",
    "CallbackConfig",
    "CallbackError",
    "GlobalBatchReader",
    "NonFiniteLossError",
    "TrainResult",
    "Trainer",
    "TrainerConfig",
    "UserError",
    "evaluate",
]
