"""With the torch shortcuts off (`trainer.torch_shortcuts`: the optimizer's step without
torch's wrapper, gradients cleared by hand, a fused optimizer's `found_inf`/`grad_scale`,
crc32c by ctypes), training takes the public paths and ends with the same weights, bit for
bit, and checkpoints get the same checksums."""

from __future__ import annotations

from functools import partial

import google_crc32c
import pytest
import torch
from toy import TokenUnit, collate, make_model, make_samples

from trainer import torch_shortcuts
from trainer.checkpoint import digest
from trainer.trainer import Trainer

OPTIMIZERS = {"fused": partial(torch.optim.AdamW, lr=0.05, fused=True),
              "foreach": partial(torch.optim.AdamW, lr=0.05, foreach=True)}


class EightEach(TokenUnit):
    """Counts 8 targets a micro-batch, so that dividing by the step's count is exact
    whether a kernel divides or a foreach op multiplies by its inverse."""

    def __call__(self, batch, metrics):
        loss, _ = super().__call__(batch, metrics)
        return loss, torch.tensor(8)


def _train(tmp_path, optimizer: str, num_accumulate: int, skip_non_finite: int):
    model = make_model()
    samples = make_samples(24, seed=3)
    batches = [collate(samples[i:i + 3]) for i in range(0, 24, 3)]
    unit = (EightEach(model) if num_accumulate > 1
            else TokenUnit(model, host_count=True))  # one process: backward takes the mean
    trainer = Trainer(unit, batches, OPTIMIZERS[optimizer](model.parameters()),
                      output_dir=tmp_path, recorders=[], progress=False,
                      num_accumulate=num_accumulate, max_num_data_epochs=1,
                      max_consecutive_non_finite=skip_non_finite)
    trainer.run()
    return trainer, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_accumulate", [1, 2])
@pytest.mark.parametrize("skip_non_finite", [0, 2])
def test_the_public_paths_train_to_the_same_weights(tmp_path, optimizer, num_accumulate,
                                                    skip_non_finite):
    fast, fast_weights = _train(tmp_path / "fast", optimizer, num_accumulate, skip_non_finite)
    with torch_shortcuts.public_only():
        public, public_weights = _train(tmp_path / "public", optimizer, num_accumulate,
                                        skip_non_finite)
    assert fast.optimizer_step.step_call._inner is not None  # the shortcuts were taken ...
    assert fast.optimizer_step.fused == (optimizer == "fused")
    assert public.optimizer_step.step_call._inner is None  # ... and here they were not
    assert not public.optimizer_step.fused and not public.optimizer_step._clear_by_hand
    assert fast.step_nr == public.step_nr == 8 // num_accumulate
    for name, value in fast_weights.items():
        assert torch.equal(value, public_weights[name]), name


def test_checksums_are_the_same_without_the_ctypes_call():
    data = torch.randn(100_000).numpy().tobytes()  # past the size the ctypes call takes
    expected = google_crc32c.value(data)
    assert digest.extend(0, memoryview(data)) == expected
    with torch_shortcuts.public_only():
        assert digest.extend(0, memoryview(data)) == expected
        assert digest.extend(digest.extend(0, data[:5000]), data[5000:]) == expected
