"""System metrics: peak memory against the kernel's own record, the data-wait share of a
loop whose reader and step take known times, MFU from the peak table, learning rates."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from trainer.observe.system_metrics import (
    DataWaitClock,
    SystemMetrics,
    flops_per_target_of,
    lr_metrics,
    memory_peak_gib,
    mfu,
    peak_flops,
)


def _vm_hwm_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_memory_peak_is_the_process_peak_rss_on_cpu():
    before = memory_peak_gib("cpu")
    block = torch.ones(96 * 2**20 // 4 * 4)  # 384 MiB of float32, touched
    block += 1
    after = memory_peak_gib(torch.device("cpu"))
    del block
    assert after == pytest.approx(_vm_hwm_gib(), abs=0.01)
    assert after >= before
    assert after >= 384 / 1024  # the block alone


def _slow_reader(n: int, seconds: float):
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_data_wait_fraction_of_a_loop_that_waits_half_the_time():
    clock = DataWaitClock()
    clock.take_fraction()  # start the window here
    for _ in clock.wrap(_slow_reader(6, 0.02)):
        time.sleep(0.02)  # the "step"
    fraction = clock.take_fraction()
    assert 0.35 < fraction < 0.65

    # The loop's way: time each draw, report over the trainer's own elapsed time.
    reader = _slow_reader(4, 0.03)
    start = time.perf_counter()
    for _ in range(4):
        clock.timed(next, reader)
    elapsed = time.perf_counter() - start
    assert clock.take_fraction(elapsed) > 0.9
    assert clock.take_fraction(1.0) == 0.0  # a new window: nothing waited yet
    assert math.isnan(clock.take_fraction(0.0))


def test_a_reader_error_is_still_timed_and_raised():
    clock = DataWaitClock()

    def fails():
        time.sleep(0.01)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        clock.timed(fails)
    assert clock.waited_s >= 0.01


def test_mfu_is_unknown_on_cpu_and_computed_from_the_table_on_a_gpu(monkeypatch):
    assert peak_flops("cpu", "bf16") is None
    assert mfu(6e6, 1e6, "cpu", torch.bfloat16) is None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {"name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names["name"])
    assert peak_flops("cuda:0", "bf16") == 989.4e12
    assert peak_flops("cuda:0", torch.float16) == 989.4e12
    assert peak_flops("cuda:0", "fp32") == 66.9e12
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert peak_flops("cuda:0", "fp32") == 494.7e12  # TF32 tensor cores
    finally:
        torch.set_float32_matmul_precision(precision)
    # 6 MFLOPs a target, 100M targets/s over 2 GPUs: 6e14 / (2 * 989.4e12).
    assert mfu(6e6, 1e8, "cuda:0", "bf16", num_devices=2) == pytest.approx(6e14 / 1978.8e12)
    assert mfu(None, 1e8, "cuda:0", "bf16") is None

    names["name"] = "NVIDIA H100 PCIe"
    assert peak_flops("cuda", "bf16") == 756e12
    names["name"] = "NVIDIA H200"
    assert peak_flops("cuda", "bf16") == 989.4e12
    names["name"] = "NVIDIA A100-SXM4-80GB"
    assert peak_flops("cuda", "bf16") == 312e12
    names["name"] = "NVIDIA L40S"  # not the L4 (first match wins)
    assert peak_flops("cuda", "bf16") == 362.05e12
    names["name"] = "NVIDIA L4"
    assert peak_flops("cuda", "bf16") == 121e12
    names["name"] = "NVIDIA GeForce GTX 1080"
    assert peak_flops("cuda", "bf16") is None
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        peak_flops("cuda", "fp8")


def test_flops_per_target_from_a_unit():
    class Stated:
        flops_per_target = 6e6

    class Method:
        def flops_per_target(self):
            return 12

    assert flops_per_target_of(Stated()) == 6e6
    assert flops_per_target_of(Method()) == 12.0
    assert flops_per_target_of(object()) is None


def test_lr_metrics_name_every_group_when_there_are_several():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    single = torch.optim.SGD([a], lr=0.1)
    assert lr_metrics(single) == {"lr": 0.1}
    two = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(two, lambda step: 0.5 ** step)
    two.step()
    scheduler.step()
    assert lr_metrics(two) == pytest.approx(
        {"lr": 0.05, "lr/group_0": 0.05, "lr/group_1": 0.005})
    tensor_lr = torch.optim.Adam([a], lr=torch.tensor(0.003))
    assert lr_metrics(tensor_lr) == pytest.approx({"lr": 0.003})


def test_system_metrics_collects_one_record():
    model = torch.nn.Linear(2, 2)
    system = SystemMetrics("cpu", "fp32", num_devices=1, flops_per_target=1e3)
    system.data_wait.add(0.25)
    values = system.collect(torch.optim.SGD(model.parameters(), lr=0.1), 1e4, elapsed_s=1.0)
    assert values["lr"] == 0.1
    assert values["data_wait_fraction"] == 0.25
    assert values["memory_peak_gib"] == pytest.approx(memory_peak_gib("cpu"), rel=0.05)
    assert "mfu" not in values  # no peak known on a CPU
