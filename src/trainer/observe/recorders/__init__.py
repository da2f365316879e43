"""Metric recorders: where the trainer's published metrics go (rank 0 only).

JSONL always, TensorBoard, W&B when installed, and the console. The trainer talks to one
:class:`CompositeRecorder` holding them all, on the training thread, through a
:class:`BufferedRecorder` that hands them records in batches; W&B sits in a
:class:`BackgroundRecorder`. Heavy imports (TensorBoard's writer, wandb)
happen only when such a recorder is created.
"""

from trainer.observe.recorders.background import BackgroundRecorder
from trainer.observe.recorders.base import CompositeRecorder, MetricRecorder
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.observe.recorders.console import ConsoleRecorder, format_record, format_value
from trainer.observe.recorders.defaults import default_recorders, training_recorder
from trainer.observe.recorders.jsonl import JsonlRecorder, read_jsonl, section_file_name
from trainer.observe.recorders.tensorboard import TensorBoardRecorder
from trainer.observe.recorders.wandb import WandbRecorder

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
]
