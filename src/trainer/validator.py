"""Validation: each eval unit over its reader, metrics synced over DP, a score picked."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from gangs import Gangs
from trainer.device import to_device
from units import EvalUnit, MetricBag


class Validator:
    """Runs every `(unit, reader)` pair in eval mode and returns `{"<unit>/<metric>": v}`."""

    def __init__(
        self,
        units: Sequence[EvalUnit[Any]],
        readers: Sequence[Iterable[Any]],
        gangs: Gangs,
        score_metric: str | None = None,
    ) -> None:
        if len(units) != len(readers):
            raise ValueError(
                f"valid_units ({len(units)}) and valid_data_readers ({len(readers)}) "
                "must pair up one to one"
            )
        names = [u.name for u in units]
        if len(set(names)) != len(names):
            raise ValueError(f"valid unit names must be unique, got {names}")
        self.units = list(units)
        self.readers = list(readers)
        self.gangs = gangs
        self.score_metric = score_metric
        if score_metric is not None:
            self._check_score_metric(score_metric)

    def _check_score_metric(self, score_metric: str) -> None:
        unit_name, _, metric = score_metric.rpartition("/")
        unit = next((u for u in self.units if u.name == unit_name), None)
        if unit is None:
            raise ValueError(
                f"score_metric '{score_metric}': no valid unit is named '{unit_name}' "
                f"(valid units: {[u.name for u in self.units]}; write '<unit name>/<metric>')"
            )
        if unit.metric_names is not None and metric not in unit.metric_names:
            raise ValueError(
                f"score_metric '{score_metric}': valid unit '{unit_name}' reports "
                f"{list(unit.metric_names)}, not '{metric}'"
            )

    def __bool__(self) -> bool:
        return bool(self.units)

    def run(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for unit, reader in zip(self.units, self.readers):
            metrics = MetricBag(self.gangs.device)
            was_training = unit.model.training
            unit.model.eval()
            try:
                with torch.inference_mode():
                    for batch in reader:
                        unit(to_device(batch, self.gangs.device), metrics)
            finally:
                unit.model.train(was_training)
            unit_values = metrics.sync_and_compute(self.gangs.dp)
            unit.derive_metrics(unit_values)
            values.update({f"{unit.name}/{k}": v for k, v in unit_values.items()})
        return values

    def score(self, values: dict[str, float]) -> float | None:
        if self.score_metric is None:
            return None
        if self.score_metric not in values:
            raise ValueError(
                f"score_metric '{self.score_metric}' was not reported by validation; "
                f"reported: {sorted(values)}"
            )
        score = values[self.score_metric]
        return score if not math.isnan(score) else math.nan
