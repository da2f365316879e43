import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.recorders import TensorBoardRecorder


def _scalars(log_dir):
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_tags_steps_and_values(tmp_path):
    recorder = TensorBoardRecorder(tmp_path / "tb")
    recorder.record("train", 1, {"loss": 2.5, "lr": 1e-3})
    recorder.record("train", 2, {"loss": 2.25, "lr": 1e-3})
    recorder.record("valid/lm", 2, {"loss": 3.125, "bad": math.nan})
    # Flushed per record: readable before close.
    scalars = _scalars(tmp_path / "tb")
    recorder.close()

    assert set(scalars) == {"train/loss", "train/lr", "valid/lm/loss", "valid/lm/bad"}
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.25)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2]
    assert scalars["train/lr"][0][1] == pytest.approx(1e-3, rel=1e-6)  # float32
    assert scalars["valid/lm/loss"] == [(2, 3.125)]
    assert math.isnan(scalars["valid/lm/bad"][0][1])


def test_no_event_file_until_first_record(tmp_path):
    TensorBoardRecorder(tmp_path / "tb").close()
    assert not (tmp_path / "tb").exists()


def test_rewind_purges_later_steps(tmp_path):
    recorder = TensorBoardRecorder(tmp_path / "tb")
    for step in range(1, 11):
        recorder.record("train", step, {"loss": float(step)})
    recorder.close()  # the run dies after step 10; the checkpoint was at step 5

    resumed = TensorBoardRecorder(tmp_path / "tb")
    resumed.rewind(5)
    for step in range(6, 9):
        resumed.record("train", step, {"loss": 100.0 + step})
    resumed.close()

    # purge_step=6 makes TensorBoard drop the old run's steps 6..10 entirely.
    assert _scalars(tmp_path / "tb")["train/loss"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 5.0),
        (6, 106.0),
        (7, 107.0),
        (8, 108.0),
    ]
