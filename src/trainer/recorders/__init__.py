"""Metric recorders: where the trainer's published metrics go (rank 0 only).

JSONL always, TensorBoard, W&B when installed, and the console. The trainer talks to one
:class:`CompositeRecorder` holding them all, on the training thread, through a
:class:`BufferedRecorder` that hands them records in batches; W&B sits in a
:class:`BackgroundRecorder`. Heavy imports (TensorBoard's writer, wandb)
happen only when such a recorder is created.
"""

from trainer.recorders.background import BackgroundRecorder
from trainer.recorders.base import CompositeRecorder, MetricRecorder
from trainer.recorders.buffered import BufferedRecorder
from trainer.recorders.console import ConsoleRecorder, format_record, format_value
from trainer.recorders.defaults import default_recorders, training_recorder
from trainer.recorders.jsonl import JsonlRecorder, read_jsonl, section_file_name
from trainer.recorders.tensorboard import TensorBoardRecorder
from trainer.recorders.wandb import WandbRecorder, wandb_available

__all__ = [
    "BackgroundRecorder",
    "BufferedRecorder",
    "CompositeRecorder",
    "ConsoleRecorder",
    "JsonlRecorder",
    "MetricRecorder",
    "TensorBoardRecorder",
    "WandbRecorder",
    "default_recorders",
    "format_record",
    "format_value",
    "read_jsonl",
    "section_file_name",
    "training_recorder",
    "wandb_available",
]
