import threading

import pytest

from trainer.observe.recorders import BackgroundRecorder, JsonlRecorder, MetricRecorder, read_jsonl


class Slow(MetricRecorder):
    def __init__(self):
        self.seen, self.release = [], threading.Event()

    def record(self, section, step_nr, values):
        self.release.wait(5)
        self.seen.append((threading.current_thread().name, step_nr, dict(values)))


def test_records_leave_the_calling_thread_and_flush_waits_for_them():
    inner = Slow()
    recorder = BackgroundRecorder(inner)
    values = {"loss": 1.0}
    recorder.record("train", 10, values)
    values["loss"] = 2.0  # the caller reuses its dict: the record must keep 1.0
    assert inner.seen == []  # returned before the record was written
    inner.release.set()
    recorder.flush()
    assert inner.seen == [("gangtrain-recorder", 10, {"loss": 1.0})]
    recorder.close()


def test_flush_before_a_checkpoint_puts_the_lines_on_disk(tmp_path):
    recorder = BackgroundRecorder(JsonlRecorder(tmp_path))
    for step in range(1, 6):
        recorder.record("train", step, {"loss": float(step)})
    recorder.flush()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics" / "train.jsonl")] == [1, 2, 3, 4, 5]
    recorder.close()


class Broken(MetricRecorder):
    def record(self, section, step_nr, values):
        raise OSError("disk full")


def test_writer_errors_reach_the_caller():
    recorder = BackgroundRecorder(Broken())
    recorder.record("train", 1, {"loss": 1.0})
    with pytest.raises(OSError, match="disk full"):
        recorder.flush()
    recorder.close()
