"""The model-agnostic training loop and its services."""

from gangs.moved import forward_names
from gangtrain.data.global_batches import GlobalBatchReader
from trainer.errors import NonFiniteLossError, UserError
from trainer.lr_schedules import WarmupCosine
from trainer.observe.callbacks import Callback, CallbackError
from trainer.result import TrainResult
from trainer.trainer import Trainer

__all__ = [
    "Callback",
    "CallbackError",
    "GlobalBatchReader",
    "NonFiniteLossError",
    "TrainResult",
    "Trainer",
    "UserError",
    "WarmupCosine",
]

# The configs and evaluate-only moved to the application shell (aliases for one release).
__getattr__ = forward_names("trainer", {
    "TrainerConfig": "gangtrain.app.config.trainer_config:TrainerConfig",
    "CallbackConfig": "gangtrain.app.config.callbacks:CallbackConfig",
    "evaluate": "gangtrain.app.evaluate:evaluate",
})
