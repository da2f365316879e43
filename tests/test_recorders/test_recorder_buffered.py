"""`BufferedRecorder`: "train" records go through in batches, nothing is held past a sync."""

from trainer.observe.recorders import BufferedRecorder, JsonlRecorder, MetricRecorder, read_jsonl


class Log(MetricRecorder):
    def __init__(self):
        self.calls = []

    def record(self, section, step_nr, values):
        self.calls.append((section, step_nr, dict(values)))

    def flush(self):
        self.calls.append(("flush",))


def test_train_records_wait_for_the_next_batch_then_go_in_order():
    inner = Log()
    recorder = BufferedRecorder(inner, max_delay_s=3600)
    values = {"loss": 1.0}
    recorder.record("train", 10, values)  # the first record goes at once
    assert inner.calls == [("train", 10, {"loss": 1.0})]
    for step in (20, 30):
        values["loss"] = step / 10  # the caller reuses its dict
        recorder.record("train", step, values)
    assert len(inner.calls) == 1  # held: the last batch is not an hour old
    recorder.record("valid", 30, {"loss": 9.0})  # a rarer section goes at once, after them
    assert inner.calls[1:] == [("train", 20, {"loss": 2.0}), ("train", 30, {"loss": 3.0}),
                               ("valid", 30, {"loss": 9.0})]


def test_flush_and_close_write_everything_held(tmp_path):
    recorder = BufferedRecorder(JsonlRecorder(tmp_path), max_delay_s=3600)
    for step in range(1, 6):
        recorder.record("train", step, {"loss": float(step)})
    path = tmp_path / "metrics" / "train.jsonl"
    assert [r["step"] for r in read_jsonl(path)] == [1]
    recorder.flush()  # before a checkpoint: every record so far is on disk
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    recorder.record("train", 6, {"loss": 6.0})
    recorder.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6]


def test_without_delay_every_record_goes_at_once():
    inner = Log()
    recorder = BufferedRecorder(inner, max_delay_s=0.0)
    for step in (1, 2, 3):
        recorder.record("train", step, {"loss": 1.0})
        assert inner.calls[-1][1] == step
