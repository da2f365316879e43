import itertools
import math
import struct

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

from trainer.observe.recorders import TensorBoardRecorder, event_file


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


def test_rewinds_in_one_second_keep_their_file_order(tmp_path, monkeypatch):
    # TensorBoard reads files in name order; unpadded, the counter's "10" sorts before "9".
    monkeypatch.setattr(event_file, "_file_counter", itertools.count(9))
    recorder = TensorBoardRecorder(tmp_path / "tb")
    for step in range(1, 5):
        recorder.record("valid", step, {"loss": float(step)})
    recorder.rewind(2)
    recorder.record("valid", 3, {"loss": 30.0})
    recorder.close()

    assert _scalars(tmp_path / "tb")["valid/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def _event_file(log_dir):
    (path,) = log_dir.glob("events.out.tfevents.*")
    return path


def _checked_records(path):
    """Every record of ``path`` through TensorBoard's own reader, which checks both CRCs."""
    reader = PyRecordReader_New(str(path))
    records = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return records
        records.append(Event.FromString(reader.record()))


def test_event_file_passes_tensorboards_crc_checks(tmp_path):
    many = {f"metric_{i}": i / 7 for i in range(200)}  # a ~5 kB event: several CRC chunks
    with TensorBoardRecorder(tmp_path / "tb") as recorder:
        recorder.record("train", 1, {"loss": 2.5})
        recorder.record("valid", 1, many)

    events = _checked_records(_event_file(tmp_path / "tb"))
    assert events[0].file_version == "brain.Event:2"
    assert [event.step for event in events[1:]] == [1, 1]
    assert [(v.tag, v.simple_value) for v in events[1].summary.value] == [("train/loss", 2.5)]
    assert len(events[2].summary.value) == 200
    assert events[2].ByteSize() > 4096


@pytest.mark.parametrize("where", ["length", "data"])
def test_tensorboards_reader_detects_a_corrupt_byte(tmp_path, where):
    with TensorBoardRecorder(tmp_path / "tb") as recorder:
        recorder.record("train", 1, {"loss": 2.5, "lr": 1e-3})
    path = _event_file(tmp_path / "tb")
    first_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    second_record = 8 + 4 + first_length + 4
    offset = second_record + (0 if where == "length" else 8 + 4 + 3)
    corrupt = bytearray(path.read_bytes())
    corrupt[offset] ^= 0x01
    path.write_bytes(bytes(corrupt))

    with pytest.raises(errors.DataLossError, match="crc32"):
        _checked_records(path)


def test_reads_back_like_torchs_summary_writer(tmp_path):
    summary_writer = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    records = [("train", step, {"loss": 10.0 / step, "lr": step * 1e-4}) for step in range(1, 11)]
    records += [("valid/lm", 5, {"loss": 3.3}), ("valid/lm", 10, {"loss": math.inf})]
    resumed = [("train", step, {"loss": 100.0 + step, "lr": 0.5}) for step in range(6, 9)]

    def torch_run(writer, run_records):
        for section, step, values in run_records:
            for name, value in values.items():
                writer.add_scalar(f"{section}/{name}", value, step)
        writer.close()

    torch_run(summary_writer(str(tmp_path / "torch")), records)
    torch_run(summary_writer(str(tmp_path / "torch"), purge_step=6), resumed)
    with TensorBoardRecorder(tmp_path / "ours") as recorder:
        for section, step, values in records:
            recorder.record(section, step, values)
    with TensorBoardRecorder(tmp_path / "ours") as recorder:
        recorder.rewind(5)
        for section, step, values in resumed:
            recorder.record(section, step, values)

    ours = _scalars(tmp_path / "ours")
    assert ours == _scalars(tmp_path / "torch")
    assert [step for step, _ in ours["train/loss"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ours["valid/lm/loss"] == [(5, pytest.approx(3.3))]  # step 10 purged


def test_event_checksums_match_tensorboards_own():
    import os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from trainer.observe.recorders.event_file import masked_crc32c

    for length in (0, 1, 7, 8, 9, 300, 4099):
        data = os.urandom(length)
        assert masked_crc32c(data) == reference(data), length
