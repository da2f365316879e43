"""Validation: each eval unit over its reader, metrics synced over DP, a score picked."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

import torch

from gangs import Gangs, any_rank_each
from trainer.errors import UserError
from trainer.lifecycle.device import to_device
from units import EvalUnit, MetricBag


class Validator:
    """Runs every `(unit, reader)` pair in eval mode and returns `{"<unit>/<metric>": v}`."""

    def __init__(
        self,
        units: Sequence[EvalUnit[Any]],
        readers: Sequence[Iterable[Any]],
        gangs: Gangs,
        score_metric: str | None = None,
        *,
        max_num_batches: int | None = None,
    ) -> None:
        """`max_num_batches`: read at most this many batches of each reader (per rank) at
        each validation; None reads them whole."""
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
        self.max_num_batches = max_num_batches
        # Batches each reader gave at the last validation: one that gave some and then none
        # was spent (a one-shot iterator the construction check could not see).
        self._last_counts = [0] * len(self.units)
        if score_metric is not None:
            self._check_score_metric(score_metric)
        self._refuse_empty_sized_readers()

    def _refuse_empty_sized_readers(self) -> None:
        """A reader with a length of 0 on every DP rank is refused now, not at the first
        validation steps later (one collective; a reader without a length is checked when it
        runs, `_check_not_spent`)."""
        has_data = [not (hasattr(r, "__len__") and len(r) == 0) for r in self.readers]
        if self.gangs.dp.size > 1 and has_data:
            has_data = any_rank_each(self.gangs.dp, has_data)
        for index, (unit, reader) in enumerate(zip(self.units, self.readers)):
            if not has_data[index]:
                ranks = " on every rank" if self.gangs.dp.size > 1 else ""
                raise UserError(
                    f"valid_data_readers[{index}] (of valid unit '{unit.name}', a "
                    f"{type(reader).__name__}) is empty (length 0){ranks}: give it data or "
                    "leave the valid unit out")

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

    def run(self, step_nr: int | None = None) -> dict[str, float]:
        """Validate (at `step_nr`, named by errors) and return the metrics."""
        values: dict[str, float] = {}
        counts = []
        for unit, reader in zip(self.units, self.readers):
            metrics = MetricBag(self.gangs.device)
            was_training = unit.model.training
            unit.model.eval()
            count = 0
            try:
                # no_grad, not inference_mode: tensors made under inference_mode (FSDP2's
                # unsharded parameters, TP's redistributed ones, rotary caches) stay inference
                # tensors, and the next training step's backward refuses them.
                with torch.no_grad():
                    for batch in islice(reader, self.max_num_batches):  # None: all
                        unit(to_device(batch, self.gangs.device), metrics)
                        count += 1
            finally:
                unit.model.train(was_training)
            counts.append(count)
            unit_values = metrics.sync_and_compute(self.gangs.dp)
            unit.derive_metrics(unit_values)
            values.update({f"{unit.name}/{k}": v for k, v in unit_values.items()})
        self._check_not_spent(counts, step_nr)
        return values

    def _check_not_spent(self, counts: list[int], step_nr: int | None) -> None:
        """Raise, on every DP rank, when a reader gave no batch on any rank (empty: its
        metrics would be NaN or absent, a score silently lost), or gave batches last time
        and none now (spent)."""
        spent = [last > 0 and count == 0 for last, count in zip(self._last_counts, counts)]
        self._last_counts = counts
        gave = [count > 0 for count in counts]
        if self.gangs.dp.size > 1:  # one collective for both
            agreed = any_rank_each(self.gangs.dp, spent + gave)
            spent, gave = agreed[:len(spent)], agreed[len(spent):]
        for index, (unit, reader) in enumerate(zip(self.units, self.readers)):
            if not gave[index] and not spent[index]:
                at = f" at step {step_nr}" if step_nr is not None else ""
                ranks = " on any rank" if self.gangs.dp.size > 1 else ""
                raise UserError(
                    f"valid_data_readers[{index}] (of valid unit '{unit.name}', a "
                    f"{type(reader).__name__}) gave no batch{ranks} at the validation{at}: "
                    "its data is empty; give it data or leave the valid unit out"
                )
            if spent[index]:
                raise ValueError(
                    f"valid_data_readers[{index}] (of valid unit '{unit.name}', a "
                    f"{type(reader).__name__}) gave batches at the last validation and none "
                    "now: it was spent; give a reader whose __iter__ starts a new pass"
                )

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


def by_unit(values: dict[str, float]) -> dict[str, dict[str, float]]:
    """Validation metrics grouped by valid unit (`{"valid": {"valid/accuracy": ...}}`): one
    file each (metrics/<unit>.jsonl), every metric under its full name, as in score_metric,
    TensorBoard, W&B and eval.jsonl."""
    sections: dict[str, dict[str, float]] = {}
    for key, value in values.items():
        sections.setdefault(key.rpartition("/")[0], {})[key] = value
    return sections
