"""Run by `test_torchrun_defaults.py` under `torchrun --nproc-per-node 2`: a Trainer and an
`evaluate` built without `gangs=`, in a script that configures no logging. Writes one
`report_rank_<r>.json` per rank; rank 0 saves the trained parameters."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from toy import PAD, TokenUnit, collate, make_model, make_samples

from gangs import setup_gangs, setup_root_gang
from gangtrain.app.evaluate import evaluate
from gangtrain.parallel import data_parallel
from trainer import Trainer
from units import EvalUnit, MetricBag

GLOBAL_BATCH, STEPS = 4, 8
# SGD, linear in the gradient: the two ranks' weights against one process's are a float32
# claim (AdamW moves an element whose gradient is rounding noise by ~lr: tests/tolerances.py)
LR = 0.5


class TokenEval(EvalUnit):
    """`token_loss`: a metric whose direction no one declared (a warning on every rank)."""

    metric_names = ("token_loss",)

    def __init__(self, model):
        self._model = model

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        loss = F.cross_entropy(self._model(x).flatten(0, 1), y.flatten(), ignore_index=PAD,
                               reduction="sum")
        metrics.update_total("token_loss", loss, (y != PAD).sum())


def shard(samples, rank, world):
    """This rank's part of each global batch of GLOBAL_BATCH samples."""
    per_rank = GLOBAL_BATCH // world
    return [collate(samples[k + rank * per_rank: k + (rank + 1) * per_rank])
            for k in range(0, len(samples), GLOBAL_BATCH)]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train = shard(make_samples(GLOBAL_BATCH * STEPS, seed=4), rank, world)
    valid = shard(make_samples(GLOBAL_BATCH * 2, seed=7), rank, world)
    report = {}

    # 1. A model not wrapped for DP: refused at construction, saying how.
    model = make_model()
    try:
        Trainer(TokenUnit(model), train, torch.optim.SGD(model.parameters(), lr=0.1),
                output_dir=out / "refused", progress=False)
        report["refused"] = None
    except ValueError as error:
        report["refused"] = str(error)

    # 2. Wrapped (with gangs the script made), but no gangs= given: one run over 2 ranks.
    model = data_parallel(make_model(), setup_gangs(setup_root_gang()))
    result = Trainer(TokenUnit(model), train, torch.optim.SGD(model.parameters(), lr=LR),
                     output_dir=out / "run", valid_units=[TokenEval(model)],
                     valid_data_readers=[valid], score_metric="valid/token_loss",
                     validate_every_n_steps=4, checkpoint_every_n_steps=4,
                     max_num_steps=STEPS, progress=False).run()
    report["score_history"] = result.score_history
    report["best_step"] = result.best_step
    if rank == 0:
        torch.save(model.module.state_dict(), out / "params.pt")

    # 3. evaluate without gangs=: the metrics synced over both ranks, one line.
    fresh = make_model(seed=9)
    report["evaluated"] = evaluate([TokenEval(fresh)], [valid], output_dir=out / "run",
                                   checkpoint="last")
    # a file per rank: two ranks' long lines on one stdout pipe can interleave
    (out / f"report_rank_{rank}.json").write_text(json.dumps(report))
    # As torch asks of a script: its groups' threads stopped before the interpreter exits
    # (an exit under load once aborted in Gloo's teardown).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
