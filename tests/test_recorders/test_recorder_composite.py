import io

from rich.console import Console

from trainer.observe.recorders import (
    CompositeRecorder,
    ConsoleRecorder,
    JsonlRecorder,
    MetricRecorder,
    read_jsonl,
)


class ListRecorder(MetricRecorder):
    """A real (in-memory) recorder: keeps what it is given."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, section, step_nr, values):
        self.log.append((self.name, "record", section, step_nr, dict(values)))

    def rewind(self, step_nr):
        self.log.append((self.name, "rewind", step_nr))

    def close(self):
        self.log.append((self.name, "close"))


class FailingClose(ListRecorder):
    def close(self):
        super().close()
        raise OSError("disk gone")


def test_forwards_in_order():
    log = []
    composite = CompositeRecorder([ListRecorder("a", log), ListRecorder("b", log)])
    composite.record("train", 3, {"loss": 1.0})
    composite.advance(4)  # neither overrides advance: nothing to forward
    composite.rewind(2)
    composite.close()
    assert log == [
        ("a", "record", "train", 3, {"loss": 1.0}),
        ("b", "record", "train", 3, {"loss": 1.0}),
        ("a", "rewind", 2),
        ("b", "rewind", 2),
        ("a", "close"),
        ("b", "close"),
    ]


def test_close_reaches_every_recorder_then_raises():
    log = []
    composite = CompositeRecorder([FailingClose("a", log), ListRecorder("b", log)])
    try:
        composite.close()
    except OSError as error:
        assert "disk gone" in str(error)
    else:
        raise AssertionError("close() swallowed the error")
    assert log == [("a", "close"), ("b", "close")]


def test_with_real_recorders(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    with CompositeRecorder([JsonlRecorder(tmp_path), ConsoleRecorder(5, console=console)]) as rec:
        for step in range(1, 6):
            rec.advance(step)
            rec.record("train", step, {"loss": 1.0 / step})
        rec.rewind(3)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics" / "train.jsonl")] == [1, 2, 3]
    assert "train step 5 | loss 0.2" in console.file.getvalue()
