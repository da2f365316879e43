"""Run by `test_peer_death.py` under `torchrun --nproc-per-node 2`: a DDP run in which rank
1 stops at step 4 as `MODE` says (`kill`: SIGKILL, as the OOM killer; `stop`: SIGSTOP, a hung
process; `slow`: sleeps past the collective timeout). Rank 0 prints `RESULT <its error>`."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from toy import TokenUnit, collate, make_model, make_samples

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Callback, Trainer

TIMEOUT_S = 4


class StopAt(Callback):
    def __init__(self, mode: str, rank: int) -> None:
        self.mode, self.rank = mode, rank

    def on_step_end(self, trainer):
        if trainer.step_nr != 4 or self.rank != 1:
            return
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3 * TIMEOUT_S)


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    gangs = setup_gangs(setup_root_gang(timeout=timedelta(seconds=TIMEOUT_S)))
    rank = gangs.root.rank
    samples = make_samples(40, seed=4)
    batches = [collate(samples[k + rank: k + rank + 1]) for k in range(0, 40, 2)]
    model = data_parallel(make_model(), gangs)
    trainer = Trainer(TokenUnit(model), batches, torch.optim.AdamW(model.parameters()),
                      output_dir=out, gangs=gangs, max_num_steps=20,
                      publish_metrics_every_n_steps=1, callbacks=[StopAt(mode, rank)],
                      recorders=[], progress=False)
    try:
        trainer.run()
    except Exception as error:  # noqa: BLE001 (reported to the test)
        print(f"RESULT rank {rank} {type(error).__name__}: {error}".splitlines()[0], flush=True)
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
