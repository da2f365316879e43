"""Saves written past the page cache (`gangtrain.io.direct_writes`) and tensors read straight into their
targets (`gangtrain.io.dcp_records`) give exactly what the buffered write and DCP's own reader give:
the same file bytes, the same model and optimizer state, bit for bit; what the fast read
does not take (a transposed parameter, a dtype change) goes through DCP's reader."""

import errno

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

from gangs import FakeGang, setup_gangs
from gangtrain.io import dcp_records, direct_writes
from gangtrain.io.direct_writes import BLOCK, BUFFERS, DirectWriteStream
from gangtrain.io.plain_values import PlainValuesOnce
from trainer import torch_shortcuts
from trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)
        # stored transposed: its bytes are not laid out row by row
        self.transposed = torch.nn.Parameter(torch.randn(6, 8).t())
        self.low = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))

    def forward(self, ids):
        x = self.embed(ids)
        return (self.body(x) @ self.transposed).sum() + self.low.float().sum()


def _trained(seed: int):
    model = _Model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        model(torch.arange(10) + i).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state(model, optimizer):
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in state.items()})
    return out


@pytest.mark.parametrize("sizes", [[0], [5], [4096], [BLOCK - 3, 7], [BLOCK, BLOCK + 1, 13]])
def test_a_direct_write_holds_exactly_the_bytes_written(tmp_path, sizes):
    chunks = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    stream = DirectWriteStream(tmp_path / "f")
    for chunk in chunks:
        assert stream.write(memoryview(chunk)) == len(chunk)
    assert stream.tell() == sum(sizes)
    stream.close()
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_a_direct_write_longer_than_its_buffers_holds_every_block_in_order(tmp_path):
    # every block different, in pieces that straddle blocks: a buffer refilled before its
    # write was done, or written twice, would show
    data = torch.randint(0, 256, ((BUFFERS + 2) * BLOCK + 4099,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    stream = DirectWriteStream(tmp_path / "f")
    assert stream.direct
    piece = BLOCK // 3 + 1
    for offset in range(0, len(data), piece):
        stream.write(data[offset:offset + piece])
    stream.close()
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("sizes", [[5], [BLOCK + 7, 3]])
def test_a_file_system_refusing_the_first_direct_write_gets_the_bytes_buffered(
        tmp_path, monkeypatch, sizes):
    write_all, refused = direct_writes._write_all, []

    def refusing(fd, view, *offset):
        if not refused:
            refused.append(len(view))
            raise OSError(errno.EINVAL, "Invalid argument")
        write_all(fd, view, *offset)

    monkeypatch.setattr(direct_writes, "_write_all", refusing)
    chunks = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    stream = DirectWriteStream(tmp_path / "f")
    assert stream.direct
    for chunk in chunks:
        stream.write(chunk)
    stream.close()
    assert refused and not stream.direct
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_saves_and_loads_equal_the_buffered_write_and_dcps_own_reader(tmp_path, monkeypatch):
    gangs = setup_gangs(FakeGang())
    model, optimizer = _trained(0)
    expected = _state(model, optimizer)

    direct = CheckpointManager(tmp_path / "direct", gangs)
    direct.save(2, model, optimizer, {})
    monkeypatch.setattr(direct_writes, "enabled", False)
    buffered = CheckpointManager(tmp_path / "buffered", gangs)
    buffered.save(2, model, optimizer, {})
    for f in (tmp_path / "direct/step_2/model_optim").glob("*.distcp"):  # .metadata: ids
        assert f.read_bytes() == (tmp_path / "buffered/step_2/model_optim" / f.name).read_bytes()

    taken: list[int] = []
    read = dcp_records.read_into_targets

    def counting(directory, storage_data, items, planner):
        items = list(items)
        left = read(directory, storage_data, items, planner)
        tensors_left = sum(item.type == LoadItemType.TENSOR for item in left)
        taken.append(sum(item.type == LoadItemType.TENSOR for item in items) - tensors_left)
        assert tensors_left == 3  # the transposed parameter and its moments: DCP's reader
        return left

    monkeypatch.setattr("trainer.checkpoint.manifest.read_into_targets", counting)
    for public in (False, True):
        other, other_optimizer = _trained(1)
        assert not torch.equal(other.body.weight, model.body.weight)
        if public:
            with torch_shortcuts.public_only():
                direct.load(2, other, other_optimizer)
        else:
            direct.load(2, other, other_optimizer)
        got = _state(other, other_optimizer)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert taken == [17]  # once (shortcuts on): 4 parameters, 8 moments, 5 step counts


def test_the_fast_read_refuses_what_it_cannot_lay_out(tmp_path, monkeypatch):
    """A checkpoint of a float32 model loaded into a bfloat16 one: DCP's reader casts."""
    gangs = setup_gangs(FakeGang())
    model = torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path, gangs)
    manager.save(1, model, None, {})
    left_to_dcp: list[int] = []
    read = dcp_records.read_into_targets

    def counting(directory, storage_data, items, planner):
        left = read(directory, storage_data, items, planner)
        left_to_dcp.append(sum(item.type == LoadItemType.TENSOR for item in left))
        return left

    monkeypatch.setattr("trainer.checkpoint.manifest.read_into_targets", counting)
    other = torch.nn.Linear(4, 3).to(torch.bfloat16)
    manager.load(1, other, None)
    assert left_to_dcp == [2]  # weight and bias: both cast by DCP's reader
    assert torch.equal(other.weight, model.weight.detach().to(torch.bfloat16))
    assert torch.equal(other.bias, model.bias.detach().to(torch.bfloat16))


def test_plain_values_saved_once_each_load_back_as_the_values_saved(tmp_path):
    # values alike to `==` but not to `torch.save` (True and 1, 0.0 and -0.0) each keep
    # their own archive; repeats of one value share one; what is not plain goes as DCP does
    values = {"int": 1, "bool": True, "float": 1.0, "zero": 0.0, "negative_zero": -0.0,
              "nan": float("nan"), "betas": (0.9, 0.999), "betas_again": (0.9, 0.999),
              "mixed": (1, True, 1.0), "list": [1, 2], "text": "adamw", "none": None,
              "weight": torch.arange(6.0)}
    planner = PlainValuesOnce()
    dcp.save(values, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    assert len(planner._archives) == 10  # every plain key but the repeated betas and the list
    loaded = {key: torch.zeros(6) if key == "weight" else None for key in values}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    for key, value in values.items():
        if key == "weight":
            assert torch.equal(loaded[key], value)
            continue
        assert type(loaded[key]) is type(value) and repr(loaded[key]) == repr(value), key
        if isinstance(value, tuple):
            assert [type(item) for item in loaded[key]] == [type(item) for item in value]
