"""The unit contracts: a unit knows the model, the trainer knows training."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Generic, TypeVar

from torch import Tensor, nn

from units.directions import (
    HIGHER_BETTER_METRICS,
    LOWER_BETTER_METRICS,
    declared_lower_better,
)
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

    def sequence_batch(self, batch: BatchT) -> Mapping[str, Tensor]:
        """The batch as tensors ``[b, t, ...]`` that can be cut along the sequence (dim 1),
        each slice still scoring what it holds: what context parallelism shards. A unit
        whose batches cannot be cut so does not override this."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say how its batch is cut along the sequence "
            "(TrainUnit.sequence_batch), which context parallelism needs")

    def set_step_nr(self, step_nr: int) -> None:  # noqa: B027  (optional hook)
        """Called before each step with the step number about to run (1-based)."""

    def set_micro_batch(self, index: int, num_micro_batches: int) -> None:  # noqa: B027
        """Optional hook: called before each micro-batch's forward with its place in the
        step (``index`` 0-based; the step ends after ``num_micro_batches - 1``, fewer than
        ``num_accumulate`` at a short last step): how a unit knows where optimizer steps fall
        without a copy of the Trainer's accumulation. Not called where a unit does not
        override it (no cost), nor by a pipeline schedule (its stages run the micro-batches
        interleaved)."""

    def derive_metrics(self, values: dict[str, float]) -> None:  # noqa: B027
        """Add metrics computed from the synced ones (e.g. perplexity from loss), in place."""


class EvalUnit(ABC, Generic[BatchT]):
    """Records metrics of one batch in evaluation mode; the trainer syncs and publishes them
    under `<name>/<metric>` (e.g. `valid/loss`)."""

    name: str = "valid"

    metric_names: Sequence[str] | None = None
    """The metrics this unit records, if known up front: lets the trainer check
    `score_metric` at construction instead of at the first validation."""

    higher_better_metrics: Collection[str] = HIGHER_BETTER_METRICS
    """Metrics that improve upwards (accuracy, F1, BLEU ...): the Trainer ranks a
    `score_metric` named here higher-better when `lower_better` is not given."""

    lower_better_metrics: Collection[str] = LOWER_BETTER_METRICS
    """Metrics that improve downwards (loss, perplexity, error rates ...)."""

    def metric_lower_better(self, metric: str) -> bool | None:
        """The direction this unit declares for `metric` (True: lower is better), or None
        when it declares none (see `units.directions`)."""
        return declared_lower_better(metric, self.higher_better_metrics,
                                     self.lower_better_metrics)

    @property
    @abstractmethod
    def model(self) -> nn.Module: ...

    @abstractmethod
    def __call__(self, batch: BatchT, metrics: MetricBag) -> None: ...

    def derive_metrics(self, values: dict[str, float]) -> None:  # noqa: B027
        """Add metrics computed from the synced ones (e.g. perplexity from loss), in place."""
