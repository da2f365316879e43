"""Data of the lm recipe: file discovery, byte stream, packed windows, global-batch reader."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from recipes.lm.data import (
    SEPARATOR,
    ByteWindowReader,
    eval_batches,
    find_source_files,
    gzip_bits_per_byte,
    load_bytes,
    split_files,
)
from trainer.errors import UserError

SEQ_LEN = 8


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    # 50 windows of 8 (+1) random bytes: every window is distinct, so orders are comparable.
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (50 * SEQ_LEN + 3,), dtype=torch.uint8, generator=generator)


def _epoch(reader: ByteWindowReader) -> list[dict[str, torch.Tensor]]:
    return list(reader)


def _assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["target_ids"], y["target_ids"])


# ---- files and bytes ---------------------------------------------------------------------


def test_stdlib_discovery_skips_test_suites() -> None:
    files = find_source_files()
    assert len(files) > 100
    assert files == sorted(files)
    excluded = {"test", "tests", "idle_test", "site-packages"}
    assert not any(excluded & set(f.parts) for f in files)
    names = {f.name for f in files}
    assert {"os.py", "json", "__init__.py"} & names  # a real stdlib


def test_discovery_excludes_by_relative_path_only(tmp_path: Path) -> None:
    root = tmp_path / "test" / "root"  # an excluded name *above* the root must not matter
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/notes.txt",
        "test/t.py",
        "pkg/tests/t.py",
        "idlelib/idle_test/t.py",
        "site-packages/lib.py",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    assert find_source_files(root) == [root / "a.py", root / "pkg" / "b.py"]


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_root_without_py_files_is_a_user_error(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "nowhere"
    if kind == "empty":
        root.mkdir()
        (root / "readme.txt").write_text("no python here")
    with pytest.raises(UserError, match=f"data root '{root}' holds no .py files"):
        find_source_files(root)


def test_split_is_deterministic_disjoint_and_complete() -> None:
    files = [Path(f"f{i:03d}.py") for i in range(100)]
    train, valid = split_files(files, valid_fraction=0.05, seed=0)
    assert len(valid) == 5 and len(train) == 95
    assert set(train).isdisjoint(valid) and set(train) | set(valid) == set(files)
    assert split_files(list(reversed(files)), 0.05, seed=0) == (train, valid)
    assert split_files(files, 0.05, seed=1)[1] != valid
    assert len(split_files(files[:3], valid_fraction=0.01)[1]) == 1  # at least one valid file


def test_load_bytes_joins_with_separator_and_caps(tmp_path: Path) -> None:
    paths = []
    for i, text in enumerate([b"abc", b"de", b"fgh"]):
        paths.append(tmp_path / f"{i}.py")
        paths[-1].write_bytes(text)
    data = load_bytes(paths)
    assert data.dtype == torch.uint8
    sep = SEPARATOR.decode()
    assert bytes(data.tolist()) == f"abc{sep}de{sep}fgh".encode()
    assert bytes(load_bytes(paths, max_bytes=5).tolist()) == f"abc{sep}d".encode()


def test_gzip_bits_per_byte_of_python_source() -> None:
    files = find_source_files()[:40]
    data = load_bytes(files)
    bpb = gzip_bits_per_byte(data)
    assert 1.0 < bpb < 3.0
    assert bpb == gzip_bits_per_byte(bytes(data.tolist()))


# ---- training reader ---------------------------------------------------------------------


def test_windows_are_packed_and_targets_shifted(data: torch.Tensor) -> None:
    reader = ByteWindowReader(data, SEQ_LEN, batch_size=5, shuffle=False)
    assert reader.num_windows == 50 and reader.num_batches_per_epoch == 10
    batch = next(iter(reader))
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].shape == batch["target_ids"].shape == (5, SEQ_LEN)
    for i in range(5):
        window = data[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1].long()
        assert torch.equal(batch["input_ids"][i], window[:-1])
        assert torch.equal(batch["target_ids"][i], window[1:])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_slices_concatenate_to_the_global_batch(data: torch.Tensor, dp_size: int) -> None:
    single = ByteWindowReader(data, SEQ_LEN, batch_size=8, seed=3)
    ranks = [ByteWindowReader(data, SEQ_LEN, 8, r, dp_size, seed=3) for r in range(dp_size)]
    for _ in range(2):  # two epochs: the per-epoch reshuffle agrees across ranks too
        expected = _epoch(single)
        per_rank = [_epoch(r) for r in ranks]
        assert all(len(p) == len(expected) == 6 for p in per_rank)
        for step, global_batch in enumerate(expected):
            for key in ("input_ids", "target_ids"):
                parts = [p[step][key] for p in per_rank]
                assert all(part.shape[0] == 8 // dp_size for part in parts)
                assert torch.equal(torch.cat(parts), global_batch[key])


def test_epoch_end_stops_and_next_epoch_reshuffles(data: torch.Tensor) -> None:
    reader = ByteWindowReader(data, SEQ_LEN, batch_size=8, seed=0)
    first, second = _epoch(reader), _epoch(reader)
    assert len(first) == len(second) == 6  # 50 windows: the incomplete 7th batch is dropped
    assert reader.state_dict() == {"epoch": 2, "batch_index": 0}
    assert not torch.equal(first[0]["input_ids"], second[0]["input_ids"])
    # Within an epoch no window repeats.
    rows = torch.cat([b["input_ids"] for b in first])
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    # Same seed, same orders; another seed, another order.
    _assert_same_batches(first, _epoch(ByteWindowReader(data, SEQ_LEN, 8, seed=0)))
    other = _epoch(ByteWindowReader(data, SEQ_LEN, 8, seed=1))
    assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])


def test_state_dict_resumes_mid_epoch_exactly(data: torch.Tensor) -> None:
    reference = ByteWindowReader(data, SEQ_LEN, batch_size=4, seed=7)
    expected = _epoch(reference) + _epoch(reference) + _epoch(reference)

    reader = ByteWindowReader(data, SEQ_LEN, batch_size=4, seed=7)
    seen = _epoch(reader)
    it = iter(reader)
    seen += [next(it) for _ in range(5)]
    state = reader.state_dict()
    assert state == {"epoch": 1, "batch_index": 5}

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = ByteWindowReader(data, SEQ_LEN, batch_size=4, seed=7)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    seen += _epoch(restored) + _epoch(restored)
    _assert_same_batches(seen, expected)


def test_state_resumes_on_another_dp_size(data: torch.Tensor) -> None:
    single = ByteWindowReader(data, SEQ_LEN, batch_size=4, seed=2)
    it = iter(single)
    for _ in range(3):
        next(it)
    state = single.state_dict()
    rest = list(it)
    halves = []
    for rank in range(2):
        reader = ByteWindowReader(data, SEQ_LEN, 4, rank, 2, seed=2)
        reader.load_state_dict(state)
        halves.append(_epoch(reader))
    for step, batch in enumerate(rest):
        assert torch.equal(torch.cat([h[step]["input_ids"] for h in halves]), batch["input_ids"])


def test_end_of_epoch_state_resumes_with_an_empty_iterator(data: torch.Tensor) -> None:
    reader = ByteWindowReader(data, SEQ_LEN, batch_size=8)
    it = iter(reader)
    for _ in range(reader.num_batches_per_epoch):
        next(it)
    state = reader.state_dict()  # last batch consumed, iterator not yet exhausted
    restored = ByteWindowReader(data, SEQ_LEN, batch_size=8)
    restored.load_state_dict(state)
    assert list(restored) == [] and list(it) == []  # both then count the epoch as done
    _assert_same_batches(_epoch(restored), _epoch(reader))


def test_bad_sizes_are_user_errors(data: torch.Tensor) -> None:
    with pytest.raises(UserError, match=r"batch_size 6\b.*data-parallel size 4\b"):
        ByteWindowReader(data, SEQ_LEN, batch_size=6, dp_rank=0, dp_size=4)
    with pytest.raises(UserError, match="fewer than one global batch"):
        ByteWindowReader(data[:20], SEQ_LEN, batch_size=4)
    reader = ByteWindowReader(data, SEQ_LEN, batch_size=8)
    with pytest.raises(UserError, match="batch_index 99"):
        reader.load_state_dict({"epoch": 0, "batch_index": 99})


# ---- validation batches ------------------------------------------------------------------


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_eval_batches_cover_every_window_once(data: torch.Tensor, dp_size: int) -> None:
    per_rank = [eval_batches(data, SEQ_LEN, 12, r, dp_size) for r in range(dp_size)]
    assert len({len(batches) for batches in per_rank}) == 1  # same count: no collective hangs
    assert len(per_rank[0]) == 5  # 50 windows in batches of 12: 4 full and one of 2
    rows = [
        torch.cat([per_rank[r][step]["input_ids"] for r in range(dp_size)])
        for step in range(len(per_rank[0]))
    ]
    inputs = torch.cat(rows)
    targets = torch.cat(
        [torch.cat([per_rank[r][s]["target_ids"] for r in range(dp_size)]) for s in range(5)]
    )
    assert inputs.shape == (50, SEQ_LEN)
    stream = data[: 50 * SEQ_LEN + 1].long()
    assert torch.equal(inputs.flatten(), stream[:-1])  # in order, each window exactly once
    assert torch.equal(targets.flatten(), stream[1:])


def test_eval_batches_max_batches(data: torch.Tensor) -> None:
    assert len(eval_batches(data, SEQ_LEN, 4, max_batches=3)) == 3
    with pytest.raises(UserError, match="shorter than one window"):
        eval_batches(data[:SEQ_LEN], SEQ_LEN, 4)
