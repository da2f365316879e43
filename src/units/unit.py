"""The unit contracts: a unit knows the model, the trainer knows training."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

from torch import Tensor, nn

from units.metrics import MetricBag

BatchT = TypeVar("BatchT")


class TrainUnit(ABC, Generic[BatchT]):
    """Turns a batch into `(loss, num_targets)`.

    The loss is a SUM over `num_targets` targets (an `int` or a 0-dim tensor, which may be
    0). The trainer divides the gradient by the target count of the whole step: every
    micro-batch on every data-parallel rank. Return `None` for `num_targets` when the loss
    is already a mean: each micro-batch then counts as one (mean of means).
    """

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The (possibly wrapped) model whose parameters the optimizer updates."""

    @abstractmethod
    def __call__(self, batch: BatchT, metrics: MetricBag) -> tuple[Tensor, int | Tensor | None]:
        """Forward one micro-batch; record unit-specific metrics into `metrics`."""

    def set_step_nr(self, step_nr: int) -> None:  # noqa: B027  (optional hook)
        """Called before each step with the step number about to run (1-based)."""

    def derive_metrics(self, values: dict[str, float]) -> None:  # noqa: B027
        """Add metrics computed from the synced ones (e.g. perplexity from loss), in place."""


class EvalUnit(ABC, Generic[BatchT]):
    """Records metrics of one batch in evaluation mode; the trainer syncs and publishes them
    under `<name>/<metric>` (e.g. `valid/loss`)."""

    name: str = "valid"

    metric_names: Sequence[str] | None = None
    """The metrics this unit records, if known up front: lets the trainer check
    `score_metric` at construction instead of at the first validation."""

    @property
    @abstractmethod
    def model(self) -> nn.Module: ...

    @abstractmethod
    def __call__(self, batch: BatchT, metrics: MetricBag) -> None: ...

    def derive_metrics(self, values: dict[str, float]) -> None:  # noqa: B027
        """Add metrics computed from the synced ones (e.g. perplexity from loss), in place."""
