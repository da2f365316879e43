import sys
import time

import pytest

from trainer.observe.recorders import WandbRecorder
from trainer.observe.recorders.wandb import wandb_available


def test_missing_wandb_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(RuntimeError, match=r"pip install gangtrain\[wandb\]"):
        WandbRecorder("proj", "run", tmp_path)


@pytest.mark.skipif(not wandb_available(), reason="wandb is not installed")
def test_offline_run_writes_under_output_dir(tmp_path):
    recorder = WandbRecorder(
        "gangtrain-test",
        "recorder-test",
        tmp_path,
        config={"lr": 1e-3},
        mode="offline",
        settings={"silent": True, "x_disable_stats": True, "disable_git": True, "console": "off"},
    )
    recorder.record("train", 1, {"loss": 2.5})
    recorder.record("valid/lm", 1, {"loss": 3.0})
    recorder.rewind(0)  # documented no-op
    recorder.record("train", 2, {"loss": 1.5})
    recorder.close()
    recorder.close()  # idempotent

    # wandb/latest-run is a symlink to the run directory: count each file once.
    run_files = sorted({path.resolve() for path in tmp_path.glob("wandb/*/*.wandb")})
    assert len(run_files) == 1
    assert recorder.run_dir.resolve() == run_files[0].parent
    # Protobuf records, keys stored as plain text. wandb's service process may still be
    # writing them when `finish()` returns (it flushes before the process exits).
    deadline = time.monotonic() + 30
    data = run_files[0].read_bytes()
    while not (b"train/loss" in data and b"valid/lm/loss" in data) and time.monotonic() < deadline:
        time.sleep(0.1)
        data = run_files[0].read_bytes()
    assert b"train/loss" in data and b"valid/lm/loss" in data
