"""Checksums computed while writing: they equal a digest of the files read back, name
their kind in the manifest, and manifests of format 1 (sha256) still verify."""

import hashlib
import json

import google_crc32c
import pytest
import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager, verify, writer
from trainer.checkpoint.digest import extend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 5))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    optim.step()
    mgr = CheckpointManager(path, setup_gangs(FakeGang()))
    mgr.save(7, model, optim, {"step": 7})
    mgr.close()
    return path / "step_7"


def test_zip_crc_is_off_only_while_the_main_thread_writes(tmp_path, monkeypatch):
    """torch.save's zip CRC-32 (redundant beside our crc32c, and most of a large save's
    time) is off while a save on the main thread writes, then back on; an async save, on
    the writer thread while the main thread may torch.save, leaves the process-wide switch
    alone. A file torch.save writes with it off still loads."""
    switched = []
    set_crc = torch.serialization.set_crc32_options
    monkeypatch.setattr(torch.serialization, "set_crc32_options",
                        lambda on: switched.append(on) or set_crc(on))
    _save(tmp_path / "sync")
    assert switched == [False, True] and torch.serialization.get_crc32_options()

    def refuse(_):
        raise AssertionError("an async save turned torch.save's zip CRC off or on")

    monkeypatch.setattr(torch.serialization, "set_crc32_options", refuse)
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 5)
    mgr = CheckpointManager(tmp_path / "async", setup_gangs(FakeGang()), async_save=True)
    mgr.save(1, model, torch.optim.AdamW(model.parameters()), {})
    mgr.close()
    assert verify(tmp_path / "async" / "step_1") is None


def test_checksums_written_while_saving_match_the_files(tmp_path, monkeypatch):
    hashed_at_commit = []
    file_entry = writer.file_entry
    monkeypatch.setattr(writer, "file_entry",
                        lambda path: hashed_at_commit.append(path.name) or file_entry(path))
    step_dir = _save(tmp_path)
    assert hashed_at_commit == []  # every file's sum was computed while writing it
    assert torch.serialization.get_crc32_options()  # torch.save's zip CRC is back on
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert "integrity" in manifest["checksums"] and "not a security" in manifest["checksums"]
    files = manifest["files"]
    on_disk = sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(files) == on_disk  # no leftover per-rank checksum files, none missing
    for rel, entry in files.items():
        data = (step_dir / rel).read_bytes()  # the reference: google_crc32c's own binding
        assert entry == {"size": len(data), "crc32c": f"{google_crc32c.value(data):08x}"}, rel


def test_crc32c_of_any_buffer_matches_the_reference():
    data = torch.randn(100_003).numpy().tobytes()
    for cut in (0, 1, 4095, 4096, 77_777):
        crc = extend(extend(0, memoryview(data)[:cut]), memoryview(data)[cut:])
        assert crc == google_crc32c.value(data)


def test_sha256_manifests_of_format_1_still_verify_and_fail_on_damage(tmp_path):
    step_dir = _save(tmp_path)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["format"] = 1
    del manifest["checksums"]
    for rel, entry in manifest["files"].items():
        sha = hashlib.sha256((step_dir / rel).read_bytes()).hexdigest()
        manifest["files"][rel] = {"size": entry["size"], "sha256": sha}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    assert verify(step_dir) is None
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    assert mgr.find_latest() == 7
    mgr.close()

    rank_file = step_dir / "rank_0.pt"
    data = bytearray(rank_file.read_bytes())
    data[-30] ^= 0x01
    rank_file.write_bytes(bytes(data))
    assert verify(step_dir) == "rank_0.pt does not match its sha256 checksum in the manifest"


def test_an_entry_without_a_checksum_is_refused(tmp_path):
    step_dir = _save(tmp_path)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    del manifest["files"]["rank_0.pt"]["crc32c"]
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    assert verify(step_dir) == "rank_0.pt has no crc32c (or sha256) checksum in the manifest"
