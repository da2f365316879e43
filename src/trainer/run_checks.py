"""Checks of what the Trainer is handed and of what it is about to save.

Settings alone are checked by `TrainerSettings`; these need the run's objects: the valid
units, the early stopper, the model, the optimizer's state (the unit's outputs are checked
in `step.forward_backward`). Each mistake gets one message that names the thing (and the
step), raised before any training or any checkpoint is lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gangs import Gang, any_rank
from gangtrain.parallel import is_data_parallel
from trainer.errors import NonFiniteLossError
from trainer.settings import TrainerSettings
from trainer.validator import Validator


def check_run(settings: TrainerSettings, validator: Validator, early_stopper: Any,
              model: nn.Module, dp_size: int) -> None:
    """Keep-best and early stopping need validation with a score; DP needs a wrapped model."""
    scheduled = (settings.validate_every_n_steps is not None
                 or settings.validate_every_n_epochs is not None)
    validates = bool(validator) and (scheduled or settings.validate_at_end)
    for name, value in (("keep_best_n_checkpoints", settings.keep_best_n_checkpoints),
                        ("early_stopper", early_stopper),
                        ("load_best_model_at_end", settings.load_best_model_at_end or None)):
        if value is None:
            continue
        if not validates:
            raise ValueError(f"{name} needs validation: give valid_units and "
                             "valid_data_readers and set validate_every_n_steps (or _epochs)")
        if settings.score_metric is None:
            raise ValueError(f"{name} needs a score_metric (e.g. 'valid/loss')")
    if scheduled or settings.validate_at_start:
        check_readers_repeat(validator)
    if settings.dtype != "fp32" and not settings.amp and any(
            p.dtype == torch.float32 for p in model.parameters()):
        raise ValueError(
            f"dtype={settings.dtype!r} with amp=False would train the fp32 model in fp32: "
            f"set amp=True (autocast to {settings.dtype}), or cast the model to "
            f"{settings.dtype} yourself"
        )
    if dp_size > 1 and not is_data_parallel(model):
        raise ValueError(
            f"the unit's model is not wrapped for data parallelism over {dp_size} ranks: "
            "call `model = parallel.data_parallel(model, gangs)` before building the "
            "optimizer and give the unit that model (under torchrun, "
            "`gangs = setup_gangs(setup_root_gang())`, and pass `gangs=gangs`)"
        )


def check_readers_repeat(validator: Validator) -> None:
    """Each valid reader can be iterated again: a generator (or any one-shot iterator) would
    give the first validation its batches and every later one nothing, so that the scores
    silently vanish. Checked without iterating (a DataLoader would start its workers)."""
    for index, (unit, reader) in enumerate(zip(validator.units, validator.readers)):
        if isinstance(reader, Iterator):
            raise ValueError(
                f"valid_data_readers[{index}] (of valid unit '{unit.name}') is a one-shot "
                f"iterator ({type(reader).__name__}): the first validation would spend it and "
                "every later one would see no batch; give a re-iterable reader (a list, a "
                "DataLoader, or an object whose __iter__ starts a new pass)"
            )


def check_finite_state(optimizer: Optimizer, root: Gang, step_nr: int,
                       last_good: Path | None) -> None:
    """Raise `NonFiniteLossError` on every rank when any rank's parameters or optimizer
    state hold a NaN or an inf: a gradient nobody measured (no clipping, no publish) can
    poison them while the loss stays finite. Run before each save: never save poison."""
    tensors = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors.append(param)
            tensors.extend(value for value in optimizer.state.get(param, {}).values()
                           if isinstance(value, Tensor) and value.is_floating_point())
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    local = [t.detach() for t in local if t.numel() > 0]
    finite = True
    if local:
        # One fused norm per tensor, read in one copy; a norm is inf for finite values near
        # 1e19 too (its squares overflow fp32), so a tensor whose norm is not finite is
        # judged by its own values.
        norms = torch._foreach_norm(local)  # noqa: SLF001 (torch's foreach norm)
        suspects = (~torch.isfinite(torch.stack([n.float() for n in norms]))).nonzero()
        finite = all(bool(torch.isfinite(local[i]).all()) for i in suspects.flatten().tolist())
    if any_rank(root, not finite):
        good = (f"the last good checkpoint is {last_good}" if last_good is not None
                else "no checkpoint was written")
        raise NonFiniteLossError(
            f"step {step_nr}: the parameters or the optimizer state are not finite (NaN or "
            f"inf), though the loss was: a gradient was not finite; not saved, {good}. "
            "Lower the learning rate, check the model's ops (sqrt or log at 0), or set "
            "max_consecutive_non_finite to skip such steps"
        )
