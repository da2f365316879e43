"""The model-agnostic training loop and its services."""

from data.global_batches import GlobalBatchReader
from trainer.config.callbacks import CallbackConfig
from trainer.config.trainer_config import TrainerConfig
from trainer.errors import NonFiniteLossError, UserError
from trainer.evaluate import evaluate
from trainer.lr_schedules import WarmupCosine
from trainer.observe.callbacks import Callback, CallbackError
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
    "WarmupCosine",
    "evaluate",
]
