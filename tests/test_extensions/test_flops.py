"""FLOPs for any model: `tflops_per_s` of an arbitrary `nn.Module` unit, counted on the first
step, against the FLOPs of a known MLP counted by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer import Trainer
from trainer.observe.recorders import JsonlRecorder, read_jsonl
from units import MetricBag, TrainUnit

B, D_IN, HIDDEN, D_OUT = 16, 32, 64, 8


class MLPUnit(TrainUnit):
    """No FLOP figure of its own: the trainer must count."""

    def __init__(self, stated: float | None = None) -> None:
        torch.manual_seed(0)
        self._model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
        if stated is not None:
            self.flops_per_target = stated

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        return F.cross_entropy(self._model(x), y, reduction="sum"), y.numel()


def by_hand_per_target() -> float:
    """Forward: two matmuls, 2*B*in*out each. Backward: both weight gradients and the hidden
    layer's input gradient (the data needs none): 3 more of the second, 1 of the first."""
    first, second = 2 * B * D_IN * HIDDEN, 2 * B * HIDDEN * D_OUT
    return (2 * first + 3 * second) / B


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, D_IN, generator=g), torch.randint(0, D_OUT, (B,), generator=g))
            for _ in range(n)]


def published(tmp_path, unit: TrainUnit, **settings) -> list[dict]:
    Trainer(unit, batches(8), torch.optim.SGD(unit.model.parameters(), lr=0.1),
            output_dir=tmp_path, max_num_steps=8, publish_metrics_every_n_steps=4,
            recorders=[JsonlRecorder(tmp_path)], **settings).run()
    return read_jsonl(tmp_path / "metrics" / "train.jsonl")


@pytest.mark.parametrize("num_accumulate", [1, 2])
def test_tflops_per_s_of_any_module_matches_a_hand_count(tmp_path, num_accumulate):
    records = published(tmp_path, MLPUnit(), num_accumulate=num_accumulate)
    assert len(records) == 2
    for record in records:
        per_target = record["tflops_per_s"] * 1e12 / record["targets_per_s"]
        assert per_target == pytest.approx(by_hand_per_target(), rel=0.05)
        # On a CPU: the MFU against a matmul timed here, under its own name, never "mfu".
        assert "mfu" not in record and 0 < record["mfu_of_measured_matmul"] < math.inf


def test_a_units_own_figure_is_taken(tmp_path):
    records = published(tmp_path, MLPUnit(stated=1e6))
    for record in records:
        assert record["tflops_per_s"] * 1e12 / record["targets_per_s"] == pytest.approx(1e6)


def test_the_cpus_matmul_peak_is_measured_before_training_not_inside_a_step(tmp_path):
    """The MFU's measured matmul (tenths of a second in bf16 on some CPUs) runs when the
    trainer is built: at the first publish it would land in the next step's time and its
    `steps_per_s`, and in any benchmark timing the steps."""
    from trainer.observe.flops import measured_matmul_peak

    measured_matmul_peak.cache_clear()
    unit = MLPUnit()
    trainer = Trainer(unit, batches(4), torch.optim.SGD(unit.model.parameters(), lr=0.1),
                      output_dir=tmp_path, max_num_steps=4, publish_metrics_every_n_steps=1,
                      recorders=[JsonlRecorder(tmp_path)])
    assert measured_matmul_peak.cache_info().misses == 1  # float32, measured once
    trainer.run()
    assert measured_matmul_peak.cache_info().misses == 1  # nothing measured while training
    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert len(records) == 4 and all(0 < r["mfu_of_measured_matmul"] < math.inf for r in records)
