"""A restarted run whose newest checkpoint is damaged resumes from the one before it (with a
warning naming the damaged one) and ends bit for bit where a run never interrupted ends; with
every checkpoint damaged it starts over as a fresh run would, its optimizer without state.

The resume hashes a checkpoint's files while it makes the optimizer state (`load_latest`):
the second test fails if a damaged checkpoint left that state behind (AdamW's step count one
ahead changes its bias correction)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from toy import TokenUnit, collate, make_model, make_samples

from trainer.trainer import Trainer

SAMPLES = [collate(make_samples(40, seed=4)[i:i + 4]) for i in range(0, 40, 4)]


def run(out: Path, max_num_steps: int) -> torch.nn.Module:
    model = make_model()
    Trainer(TokenUnit(model), SAMPLES, torch.optim.AdamW(model.parameters(), lr=1e-2),
            output_dir=out, max_num_steps=max_num_steps, checkpoint_every_n_steps=3,
            keep_last_n_checkpoints=None, progress=False, seed=0).run()
    return model


def damage(step_dir: Path) -> None:
    """One byte of the model and optimizer file flipped: same size, another checksum."""
    data_file = next((step_dir / "model_optim").glob("*.distcp"))
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data_file.write_bytes(bytes(data))


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(
        tmp_path, caplog):
    straight = run(tmp_path / "straight", 8)
    run(tmp_path / "stopped", 6)  # checkpoints at steps 3 and 6
    damage(tmp_path / "stopped" / "checkpoints" / "step_6")
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        resumed = run(tmp_path / "stopped", 8)
    messages = [r.getMessage() for r in caplog.records]
    assert any("step_6 cannot be loaded" in m and "crc32c" in m and "skipped" in m
               for m in messages), messages
    assert any("resumed from" in m and "(step 3)" in m for m in messages), messages
    assert_same_weights(resumed, straight)


def test_with_every_checkpoint_damaged_the_run_starts_over_as_a_fresh_run(tmp_path, caplog):
    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "stopped", 6)
    for step in (3, 6):
        damage(tmp_path / "stopped" / "checkpoints" / f"step_{step}")
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        again = run(tmp_path / "stopped", 4)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot be loaded" in m for m in messages) == 2, messages
    assert not any("resumed from" in m for m in messages), messages
    assert_same_weights(again, straight)
