"""A full disk says so, and how much the save needed, on a real small file system (a tmpfs
mounted for the test; tests run as root here and in CI)."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from tiny import GlobalRows
from torch import nn

from trainer import Trainer
from trainer.checkpoint import CheckpointError, verify
from trainer.checkpoint.disk_space import is_disk_full
from units.regression import SquaredErrorUnit


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs at tmp_path/disk."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


class Wide(nn.Module):
    """1 MiB of parameters: with AdamW's two moments a checkpoint of about 3 MiB."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(3, 512)
        self.wide = nn.Linear(512, 512)
        self.out = nn.Linear(512, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.wide(torch.tanh(self.inner(x)))))


def test_a_save_that_does_not_fit_says_the_disk_is_full_and_how_much_it_needed(small_disk):
    model = Wide()
    out = small_disk / "run"
    trainer = Trainer(SquaredErrorUnit(model), GlobalRows(), torch.optim.AdamW(model.parameters()),
                      output_dir=out, max_num_steps=4, checkpoint_every_n_steps=1,
                      keep_last_n_checkpoints=1, recorders=[], progress=False)
    with pytest.raises(CheckpointError) as failed:
        trainer.run()
    message = str(failed.value)
    # The first checkpoint fits; the second, written before the first may go, does not.
    assert message.startswith(f"saving step 2 failed on rank 0: the disk holding {out}"), message
    match = re.search(r"is full: the checkpoint needs about (\d+\.\d) MiB, (\d+\.\d) MiB is free",
                      message)
    assert match, message
    needed, free = float(match.group(1)), float(match.group(2))
    assert 3.0 < needed < 5.0 and free < needed
    assert "earlier checkpoints are intact" in message
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert steps == ["step_1"] and verify(out / "checkpoints" / "step_1") is None
    assert not list((out / "checkpoints").glob(".tmp*"))


def test_a_write_that_finds_the_disk_full_is_recognised(small_disk):
    with pytest.raises(RuntimeError) as failed:  # torch's own words: "unexpected pos ..."
        torch.save(torch.zeros(4 << 20), small_disk / "too_big.pt")
    assert is_disk_full(failed.value), str(failed.value)
    assert not is_disk_full(RuntimeError("a shape mismatch"))
