"""`CheckpointManager(on_commit=...)`: what `Callback.on_checkpoint_saved` hangs on. It runs
once per committed save, when the directory is complete under its final name, whether the
save was blocking or asynchronous."""

from __future__ import annotations

import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager


def test_on_commit_sees_each_complete_directory(tmp_path):
    seen = []

    def on_commit(step_nr, path):
        # Complete and renamed: the manifest is there, the temporary name is gone.
        seen.append((step_nr, path, (path / "manifest.json").is_file(),
                     (tmp_path / f".tmp_step_{step_nr}").exists()))

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, setup_gangs(FakeGang()), async_save=True,
                                on_commit=on_commit)
    manager.save(1, model, optimizer, {"n": 1}, blocking=True)
    assert seen == [(1, tmp_path / "step_1", True, False)]
    manager.save(2, model, optimizer, {"n": 2})  # asynchronous: committed by wait()
    manager.wait()
    manager.save(3, model, optimizer, {"n": 3})
    manager.close()  # commits step 3
    assert seen == [(1, tmp_path / "step_1", True, False), (2, tmp_path / "step_2", True, False),
                    (3, tmp_path / "step_3", True, False)]
    assert manager.steps() == [1, 2, 3]
