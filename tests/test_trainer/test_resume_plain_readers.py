"""A resumed run over a reader without a state (a plain list, a user's re-iterable class)
continues where the interrupted run was: the new pass skips the batches the interrupted
epoch had drawn, as HF's Trainer does, and the run ends bit for bit where a run never
interrupted ends. A reader whose passes differ (a shuffling DataLoader) is refused by name
mid-epoch instead of training other batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from toy import TokenUnit, collate, make_model, make_samples

from trainer.errors import UserError
from trainer.observe.recorders import read_jsonl
from trainer.trainer import Trainer

SAMPLES = [collate(make_samples(40, seed=4)[i:i + 4]) for i in range(0, 40, 4)]


class Batches:
    """A user's reader class: re-iterable, no state_dict."""

    def __iter__(self):
        return iter(SAMPLES)


def run(out: Path, reader, max_num_steps: int) -> torch.nn.Module:
    model = make_model()
    Trainer(TokenUnit(model), reader, torch.optim.AdamW(model.parameters(), lr=1e-2),
            output_dir=out, num_accumulate=3, max_num_steps=max_num_steps,
            checkpoint_every_n_steps=2, publish_metrics_every_n_steps=1, progress=False,
            seed=0).run()
    return model


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics" / "train.jsonl")}


@pytest.mark.parametrize("reader", [SAMPLES, Batches()], ids=["list", "user_class"])
def test_a_run_stopped_mid_epoch_over_a_stateless_reader_resumes_where_it_was(tmp_path, reader):
    straight = run(tmp_path / "straight", reader, 8)  # 24 batches: 2.4 passes
    # Stopped at step 5 (15 batches: mid-pass 1), and at step 2 of the resumed run's first
    # pass: each resume continues a pass.
    run(tmp_path / "stopped", reader, 5)
    resumed = run(tmp_path / "stopped", reader, 8)
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")


def test_a_shuffling_data_loader_without_a_state_is_not_resumed_mid_epoch(tmp_path):
    loader = DataLoader(make_samples(40, seed=4), batch_size=4, shuffle=True,
                        collate_fn=collate)
    run(tmp_path, loader, 1)  # 3 batches of 10: mid-pass
    with pytest.raises(UserError, match="the run stopped mid-epoch and the data reader "
                                        "\\(DataLoader\\) has no state_dict.*RandomSampler"):
        run(tmp_path, loader, 2)
