"""The gangs a `Trainer` or `evaluate` uses when it is given none.

One process: a `FakeGang` (no process group). Under torchrun (or any launcher that sets
`WORLD_SIZE` > 1, or a process group already set up) the torchrun world,
`setup_gangs(setup_root_gang(device))`, as Lightning does: a forgotten `gangs=` would
otherwise make every rank train (or score) a run of its own in the same directory, and the
first checkpoint save crash on another rank's temporary files.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from gangs import FakeGang, Gangs, setup_gangs, setup_root_gang
from trainer.observe.console_log import show_on_console

log = logging.getLogger("gangtrain")


def under_torchrun() -> bool:
    """Whether this process is one rank of a job of several."""
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def default_gangs(gangs: Gangs | None, model: nn.Module | None, who: str) -> Gangs:
    """`gangs` when given; else the torchrun world on the device of `model`'s parameters
    under torchrun, and one process otherwise. `who` names the caller in the log line."""
    if gangs is not None:
        return gangs
    if not under_torchrun():
        return setup_gangs(FakeGang())
    gangs = setup_gangs(setup_root_gang(device_of(model) if model is not None else None))
    show_on_console(gangs.root.rank)
    if gangs.root.rank == 0:
        log.info("%s without gangs= under torchrun: using the torchrun world (%d ranks, "
                 "data parallel, on %s)", who, gangs.root.size, gangs.device)
    return gangs


def device_of(model: nn.Module) -> torch.device | None:
    """The device of `model`'s first parameter (None without one, or on the meta device)."""
    param = next(model.parameters(), None)
    return param.device if param is not None and param.device.type != "meta" else None
