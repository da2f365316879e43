"""A checkpoint stays inside its step directory, and its free-space estimate covers what a
save writes: `.metadata` that points DCP's storage outside the directory (past the
manifest's checksums) is refused on load; a model of many small tensors is estimated at no
less than the bytes written (it was 12x low)."""

from __future__ import annotations

import pickle
import shutil

import pytest
from test_ckpt_integrity import _manager, _model, _replace_and_reseal, _saved

from benchmarks.disk_estimate import measure
from trainer.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_dcp_storage_outside_the_step_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    _saved(run)
    step_dir = run / "step_4"
    metadata_path = step_dir / "model_optim" / ".metadata"
    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 (our own file, in a test)
    info = next(iter(metadata.storage_data.values()))
    outside = tmp_path / "outside.distcp"  # the same bytes, out of the manifest's reach
    shutil.copy(step_dir / "model_optim" / info.relative_path, outside)
    for entry in metadata.storage_data.values():
        if entry.relative_path == info.relative_path:
            entry.relative_path = "../../../outside.distcp"

    def write(path):
        with open(path, "wb") as f:
            pickle.dump(metadata, f)

    _replace_and_reseal(step_dir, "model_optim/.metadata", write)
    manager = _manager(run)
    with pytest.raises(UserError, match=r"refusing to read .*step_4/model_optim/\.metadata: it "
                                        r"points to storage '\.\./\.\./\.\./outside\.distcp' "
                                        r"outside .*step_4/model_optim"):
        manager.load(manager.find_latest(), _model(), None)
    manager.close()


def test_the_free_space_estimate_covers_a_model_of_many_small_tensors():
    written, estimate, _ = measure(2000, 4)
    assert estimate >= written, (estimate, written)
    # and stays close for a model of large tensors (the data dominates)
    written, estimate, _ = measure(20, 100_000)
    assert written <= estimate <= 1.2 * written, (estimate, written)
