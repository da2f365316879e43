import json
import math

import pytest

from trainer.observe.recorders import JsonlRecorder, read_jsonl, section_file_name


def _steps(path):
    return [record["step"] for record in read_jsonl(path)]


def test_records_read_back_exactly(tmp_path):
    recorder = JsonlRecorder(tmp_path)
    recorder.record("train", 1, {"loss": 2.3141592653589793, "num_targets": 4096})
    recorder.record("train", 2, {"loss": 0.1 + 0.2, "lr": 1e-3})
    recorder.record("valid/lm", 2, {"loss": 3.5})

    train = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] == 2.3141592653589793
    assert train[0]["num_targets"] == 4096 and isinstance(train[0]["num_targets"], int)
    assert train[1]["loss"] == 0.1 + 0.2 and train[1]["lr"] == 1e-3
    assert all(isinstance(r["time"], float) for r in train)
    assert read_jsonl(tmp_path / "metrics" / "valid_lm.jsonl")[0]["loss"] == 3.5
    recorder.close()


def test_each_record_is_flushed_before_close(tmp_path):
    recorder = JsonlRecorder(tmp_path)
    recorder.record("train", 7, {"loss": 1.0})
    # Read with plain json while the recorder still holds the file open.
    lines = (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 7
    recorder.close()


def test_non_finite_values_are_valid_json_and_round_trip(tmp_path):
    with JsonlRecorder(tmp_path) as recorder:
        recorder.record("train", 1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5})

    raw = (tmp_path / "metrics" / "train.jsonl").read_text()
    strict = json.loads(raw, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))
    assert (strict["a"], strict["b"], strict["c"]) == ("nan", "inf", "-inf")

    record = read_jsonl(tmp_path / "metrics" / "train.jsonl")[0]
    assert math.isnan(record["a"]) and record["b"] == math.inf and record["c"] == -math.inf
    assert record["d"] == 1.5


def test_rewind_drops_later_steps_then_appends(tmp_path):
    recorder = JsonlRecorder(tmp_path)
    for step in range(1, 11):
        recorder.record("train", step, {"loss": float(step)})
        if step % 5 == 0:
            recorder.record("valid/lm", step, {"loss": float(step)})
    recorder.close()  # the run dies

    resumed = JsonlRecorder(tmp_path)  # a new process resumes from step 6
    resumed.rewind(6)
    assert _steps(tmp_path / "metrics" / "train.jsonl") == [1, 2, 3, 4, 5, 6]
    assert _steps(tmp_path / "metrics" / "valid_lm.jsonl") == [5]
    assert not list((tmp_path / "metrics").glob("*.tmp"))

    for step in range(7, 9):
        resumed.record("train", step, {"loss": 100.0 + step})
    resumed.close()
    train = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in train[-3:]] == [6.0, 107.0, 108.0]


def test_rewind_while_open_and_torn_line(tmp_path):
    recorder = JsonlRecorder(tmp_path)
    for step in range(1, 4):
        recorder.record("train", step, {"loss": 1.0})
    with open(tmp_path / "metrics" / "train.jsonl", "a") as fp:
        fp.write('{"step": 4, "lo')  # a process killed mid-line

    recorder.rewind(2)  # also closes the open handle, which would write to the old file
    recorder.record("train", 3, {"loss": 9.0})
    recorder.close()
    assert _steps(tmp_path / "metrics" / "train.jsonl") == [1, 2, 3]


def test_append_after_torn_line_starts_a_new_line(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    with JsonlRecorder(tmp_path) as recorder:
        recorder.record("train", 2, {"loss": 1.0})
    assert [r.get("loss") for r in read_jsonl(tmp_path / "metrics" / "train.jsonl")] == [
        None,
        1.0,
    ]


def test_reserved_names_and_file_names(tmp_path):
    with JsonlRecorder(tmp_path) as recorder, pytest.raises(ValueError, match="'step'"):
        recorder.record("train", 1, {"step": 1.0})
    assert section_file_name("valid/lm") == "valid_lm.jsonl"
    with pytest.raises(ValueError):
        section_file_name("")
