"""The pre-save check that nothing saved is NaN or inf cannot overflow on finite values: a
finite loss spike (x1e12 here, no clipping) leaves AdamW's second moments near 4e19, whose
fp32 norm is inf; the checkpoint is saved all the same (it was refused as "not
finite"), and a real NaN is still refused."""

from __future__ import annotations

import math

import pytest
import torch
from test_scores_rules import batches
from toy import TokenUnit, make_model

from trainer.checkpoint import read_model_state
from trainer.errors import NonFiniteLossError
from trainer.trainer import Trainer


class Spike(TokenUnit):
    """The loss times `factor` at step 2."""

    def __init__(self, model, factor: float) -> None:
        super().__init__(model)
        self.factor, self.step_nr = factor, 0

    def set_step_nr(self, step_nr: int) -> None:
        self.step_nr = step_nr

    def __call__(self, batch, metrics):
        loss, count = super().__call__(batch, metrics)
        return (loss * self.factor if self.step_nr == 2 else loss), count


def run(out, factor):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(Spike(model, factor), batches(), optimizer, output_dir=out,
                      max_num_steps=4, checkpoint_every_n_steps=4,
                      publish_metrics_every_n_steps=4, recorders=[], progress=False)
    trainer.run()
    return optimizer


def test_a_finite_loss_spike_is_saved(tmp_path):
    optimizer = run(tmp_path, 1e12)
    second_moments = [s["exp_avg_sq"] for s in optimizer.state.values()]
    biggest = max(m.abs().max().item() for m in second_moments)
    assert math.isfinite(biggest) and biggest > 1e18  # finite, but its norm overflows fp32
    assert not all(math.isfinite(n) for n in
                   torch._foreach_norm(second_moments))  # noqa: SLF001 (what the check did)
    state = read_model_state(tmp_path / "checkpoints" / "step_4")
    assert all(torch.isfinite(t).all() for t in state.values())


def test_a_nan_is_still_refused(tmp_path):
    with pytest.raises(NonFiniteLossError, match="not finite"):
        run(tmp_path, math.inf)
