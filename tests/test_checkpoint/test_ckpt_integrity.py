import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointError, CheckpointManager, verify, writer
from trainer.checkpoint.manifest import file_entry
from trainer.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _manager(path, **kwargs):
    return CheckpointManager(path, setup_gangs(FakeGang()), **kwargs)


def _saved(path, steps=(3, 4)):
    mgr = _manager(path)
    model = _model()
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(step, model, None, {"step": step})
    mgr.close()
    return model


def test_leftover_tmp_dir_is_removed_and_never_loaded(tmp_path):
    _saved(tmp_path)
    tmp = tmp_path / ".tmp_step_5"
    (tmp / "model_optim").mkdir(parents=True)
    (tmp / "rank_0.pt").write_bytes(b"half written")
    mgr = _manager(tmp_path)
    assert not tmp.exists()
    assert mgr.find_latest() == 4 and mgr.steps() == [3, 4]
    mgr.close()


def test_truncated_file_falls_back_to_previous(tmp_path, caplog):
    _saved(tmp_path)
    data = tmp_path / "step_4" / "model_optim" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    mgr = _manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert mgr.find_latest() == 3
    assert any("step_4" in r.getMessage() and "bytes" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="step_4 cannot be loaded"):
        mgr.load(4, _model(), None)
    assert mgr.load(3, _model(), None) == {"step": 3}
    mgr.close()


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path, caplog):
    _saved(tmp_path)
    rank_file = tmp_path / "step_4" / "rank_0.pt"
    data = bytearray(rank_file.read_bytes())
    data[-30] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    mgr = _manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert mgr.find_latest() == 3
    assert any("step_4" in r.getMessage() and "crc32c checksum" in r.getMessage() for r in caplog.records)
    mgr.close()


def test_missing_manifest_falls_back_to_previous(tmp_path, caplog):
    _saved(tmp_path)
    (tmp_path / "step_4" / "manifest.json").unlink()
    mgr = _manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert mgr.find_latest() == 3
    assert any("step_4" in r.getMessage() and "manifest" in r.getMessage()
               for r in caplog.records)
    assert mgr.steps() == [3]
    mgr.close()


def test_nothing_valid_gives_none(tmp_path):
    mgr = _manager(tmp_path)
    assert mgr.find_latest() is None and mgr.steps() == [] and mgr.last_step is None
    mgr.close()


def test_failed_write_leaves_no_directory(tmp_path, monkeypatch):
    mgr = _manager(tmp_path)
    model = _model()
    mgr.save(1, model, None, {})

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(writer.dcp, "save", broken_save)  # the save's one call of DCP
    with pytest.raises(CheckpointError, match="saving step 2 failed.*disk full"):
        mgr.save(2, model, None, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step_1"]
    monkeypatch.undo()
    mgr.save(2, model, None, {})
    assert mgr.steps() == [1, 2]
    mgr.close()


def test_resave_replaces_existing_step(tmp_path):
    mgr = _manager(tmp_path)
    model = _model()
    mgr.save(1, model, None, {"v": 1})
    mgr.save(1, model, None, {"v": 2})
    assert mgr.load(1, _model(), None) == {"v": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    mgr.close()


# --- no arbitrary unpickling -----------------------------------------------------------------


def _make_marker(path: str) -> None:
    Path(path).write_text("code ran")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_make_marker, (self.marker,))


def _replace_and_reseal(step_dir: Path, rel: str, write) -> None:
    """Replace a file and update its manifest entry, as an attacker could."""
    write(step_dir / rel)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][rel] = file_entry(step_dir / rel)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    assert verify(step_dir) is None  # the checksums no longer protect us


def test_payload_is_live(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(_Evil(marker)))
    assert marker.exists()  # so the refusals below really prevented code from running


def test_malicious_rank_file_is_refused(tmp_path):
    _saved(tmp_path)
    marker = tmp_path / "marker"
    _replace_and_reseal(tmp_path / "step_4", "rank_0.pt",
                        lambda p: torch.save({"x": _Evil(marker)}, p))
    mgr = _manager(tmp_path)
    with pytest.raises(UserError, match="refusing to load .*step_4/rank_0.pt"):
        mgr.load(mgr.find_latest(), _model(), None)
    assert not marker.exists()
    mgr.close()


def test_malicious_dcp_metadata_is_refused(tmp_path):
    _saved(tmp_path)
    marker = tmp_path / "marker"

    def write(path):
        with open(path, "wb") as f:
            pickle.dump(_Evil(marker), f)

    _replace_and_reseal(tmp_path / "step_4", "model_optim/.metadata", write)
    mgr = _manager(tmp_path)
    with pytest.raises(UserError, match=r"refusing to read .*\.metadata.*not a checkpoint record"):
        mgr.load(mgr.find_latest(), _model(), None)
    assert not marker.exists()
    mgr.close()


def test_load_latest_on_two_ranks_skips_a_damaged_newest_checkpoint(tmp_path):
    """Rank 0 hashes, every rank makes its optimizer state meanwhile: both ranks skip the
    damaged step 4 together and load step 3; with step 3 damaged too, both start without
    a checkpoint and their optimizers without state."""
    from ranks import run_ranks

    from gangs import setup_root_gang

    def fn():
        gangs = setup_gangs(setup_root_gang(device="cpu"))
        model = _model()
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        mgr = CheckpointManager(tmp_path, gangs)
        saved = {}
        for step in range(1, 5):  # AdamW's step count is the step's
            model(torch.ones(5, 3)).sum().backward()
            optim.step()
            optim.zero_grad()
            if step >= 3:
                mgr.save(step, model, optim, {"step": step})
            saved[step] = model.weight.detach().clone()
        if gangs.root.rank == 0:
            data_file = tmp_path / "step_4" / "rank_1.pt"
            data = bytearray(data_file.read_bytes())
            data[-30] ^= 0xFF
            data_file.write_bytes(bytes(data))
        gangs.root.barrier()

        fresh = torch.nn.Linear(3, 2)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        step, rank_state = mgr.load_latest(fresh, fresh_optim)
        loaded = torch.equal(fresh.weight.detach(), saved[3])
        steps_in_state = {int(s["step"]) for s in fresh_optim.state.values()}

        if gangs.root.rank == 0:
            (tmp_path / "step_3" / "manifest.json").unlink()
        gangs.root.barrier()
        another = torch.nn.Linear(3, 2)
        other = torch.optim.AdamW(another.parameters(), lr=0.1)
        none_left = mgr.load_latest(another, other)
        mgr.close()
        return step, rank_state, loaded, steps_in_state, none_left, len(other.state)

    for step, rank_state, loaded, steps_in_state, none_left, left in run_ranks(fn):
        assert (step, rank_state["step"], loaded, steps_in_state) == (3, 3, True, {3})
        assert none_left == (None, {}) and left == 0
