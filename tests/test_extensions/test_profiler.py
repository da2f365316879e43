"""The step profiler on a real loop: which steps the trace holds (read back from the Chrome /
Perfetto JSON), which ranks write one, a run that ends mid-recording, the config."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from pydantic import ValidationError

from trainer.observe.profiler import ProfilerConfig, StepProfiler


def _train(profiler: StepProfiler, num_steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    try:
        for _ in range(num_steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()
    finally:
        profiler.close()


def _profiler_steps(path) -> list[int]:
    trace = json.loads(path.read_text())
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::addmm" in names  # the model's matmuls are in it
    return sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))


def test_records_the_steps_after_the_skipped_ones(tmp_path, caplog):
    config = ProfilerConfig(skip_steps=2, record_steps=3)
    with caplog.at_level(logging.INFO, logger="gangtrain"):
        profiler = config.build(tmp_path, rank=0, device="cpu")
        assert profiler.recording_steps == (3, 5)
        _train(profiler, num_steps=8)
    path = tmp_path / "profile" / "rank_0.step_3-5.pt.trace.json"
    assert profiler.trace_path == path
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [path.name]
    # The profiler counts from 0: trainer steps 3-5 are its steps 2-4; the skipped steps,
    # the warm-up (step 2) and the steps after are not in the trace.
    assert _profiler_steps(path) == [2, 3, 4]
    assert "profiler: recording steps 3-5 of ranks [0]" in caplog.text
    assert f"profiler: rank 0 wrote the trace of steps 3-5 to {path}" in caplog.text


def test_without_skipped_steps_and_with_memory(tmp_path):
    config = ProfilerConfig(skip_steps=0, record_steps=2, record_memory=True)
    profiler = StepProfiler(config, tmp_path, rank=0, device="cpu")
    _train(profiler, num_steps=4)
    path = tmp_path / "profile" / "rank_0.step_1-2.pt.trace.json"
    assert _profiler_steps(path) == [0, 1]
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in events)  # allocations recorded


def test_a_resumed_run_counts_from_its_start(tmp_path):
    profiler = ProfilerConfig(skip_steps=1, record_steps=1).build(tmp_path, rank=0,
                                                                   device="cpu", start_step=40)
    _train(profiler, num_steps=3)
    assert profiler.trace_path == tmp_path / "profile" / "rank_0.step_42-42.pt.trace.json"


def test_only_the_chosen_ranks_record(tmp_path):
    config = ProfilerConfig(skip_steps=1, record_steps=1, ranks=[1])
    not_me = config.build(tmp_path, rank=0, device="cpu")
    assert not not_me.enabled
    _train(not_me, num_steps=3)
    assert not (tmp_path / "profile").exists()

    me = config.build(tmp_path, rank=1, device="cpu")
    _train(me, num_steps=3)
    assert me.trace_path == tmp_path / "profile" / "rank_1.step_2-2.pt.trace.json"

    everyone = ProfilerConfig(skip_steps=1, record_steps=1, ranks=None)
    assert everyone.build(tmp_path, rank=7, device="cpu").enabled
    everyone.build(tmp_path, rank=7, device="cpu").close()


def test_a_run_that_ends_mid_recording_writes_what_it_recorded(tmp_path, caplog):
    profiler = StepProfiler(ProfilerConfig(skip_steps=1, record_steps=5), tmp_path, rank=0,
                            device="cpu")
    with caplog.at_level(logging.INFO, logger="gangtrain"):
        _train(profiler, num_steps=3)
    path = tmp_path / "profile" / "rank_0.step_2-3.pt.trace.json"
    # Steps 2-3 are the profiler's 1-2; its step 3, begun after the last step, is empty.
    assert _profiler_steps(path)[:2] == [1, 2]
    assert "cut short: the run ended at step 3" in caplog.text


def test_a_run_that_ends_before_recording_writes_nothing(tmp_path):
    profiler = StepProfiler(ProfilerConfig(skip_steps=5, record_steps=2), tmp_path, rank=0,
                            device="cpu")
    _train(profiler, num_steps=5)  # step 5 is the warm-up
    assert profiler.trace_path is None
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("skip_steps", -1, "greater than or equal to 0"),
    ("record_steps", 0, "greater than or equal to 1"),
    ("recrod_steps", 2, "Extra inputs are not permitted"),
])
def test_config_mistakes_name_the_field(key, value, message):
    with pytest.raises(ValidationError) as info:
        ProfilerConfig.model_validate({key: value})
    error = info.value.errors()[0]
    assert error["loc"] == (key,)
    assert message in error["msg"]


def test_tensorboard_profiler_plugin_reads_the_trace(tmp_path):
    """The TensorBoard plugin's own parser (``pip install torch-tb-profiler``; skipped
    without it) builds its views from the trace: overview, operators, trace, memory."""
    data_module = pytest.importorskip("torch_tb_profiler.profiler.data")
    generator_module = pytest.importorskip("torch_tb_profiler.profiler.run_generator")
    consts = pytest.importorskip("torch_tb_profiler.consts")
    profiler = StepProfiler(ProfilerConfig(skip_steps=2, record_steps=3, record_memory=True),
                            tmp_path, rank=0, device="cpu")
    _train(profiler, num_steps=6)
    path = profiler.trace_path
    match = consts.WORKER_PATTERN.match(path.name)  # how the plugin finds traces in a run dir
    assert match is not None and match.group(1) == "rank_0.step_3-5"
    data = data_module.RunProfileData.parse(match.group(1), None, str(path), str(tmp_path))
    assert data.steps_names == ["2", "3", "4"]
    run = generator_module.RunGenerator(match.group(1), None, data).generate_run_profile()
    assert {"overall", "operator", "trace", "memory"} <= {view.name for view in run.views}
