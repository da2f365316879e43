"""Gradient accumulation under FSDP2 and HSDP runs the collectives it needs and no more
(`trainer.step.accumulation`), and the result equals one process's.

The collectives are counted as they reach torch's dispatcher (`c10d` ops, with the name of
the process group they run on), per optimizer step, on real Gloo ranks running the Trainer.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Callback
from trainer.trainer import Trainer
from units.regression import SquaredErrorUnit

NUM_ACCUMULATE = 4
NUM_STEPS = 2
GLOBAL_ROWS = 8  # per micro-batch, split over the DP ranks
NUM_FSDP_GROUPS = 3  # two blocks, then the root (the head)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).squeeze(-1)


def micro_batches(rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(NUM_ACCUMULATE * NUM_STEPS):
        x, y = torch.randn(GLOBAL_ROWS, 6, generator=g), torch.randn(GLOBAL_ROWS, generator=g)
        out.append((x[rank::dp], y[rank::dp]))
    return out


def _group_name(arg: object) -> str | None:
    try:
        return dist.ProcessGroup.unbox(arg).group_name
    except (RuntimeError, TypeError):
        return None


class CollectiveCounter(TorchDispatchMode):
    """Counts `(c10d op, process group name)` as the ops are dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            groups = [name for a in args if isinstance(a, torch.ScriptObject)
                      if (name := _group_name(a)) is not None]
            self.counts[(func.__name__.split(".")[0], groups[0] if groups else "?")] += 1
        return func(*args, **(kwargs or {}))


class PerStep(Callback):
    """The counter's counts of each optimizer step."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.steps: list[Counter[tuple[str, str]]] = []

    def on_train_start(self, trainer) -> None:
        self.counter.counts.clear()

    def on_step_end(self, trainer) -> None:
        self.steps.append(Counter(self.counter.counts))
        self.counter.counts.clear()


def train(reduce_every: bool, dp_shard_size: int | None = None):
    """Parameters after NUM_STEPS steps, and per step the count of each collective kind on
    the shard group ("shard") and the replicate group ("replicate")."""
    if dist.is_initialized():
        gangs = setup_gangs(setup_root_gang(), dp_shard_size=dp_shard_size)
        model = data_parallel(Net(), gangs, "fsdp")
    else:
        gangs, model = None, Net()
    dp_rank, dp_size = (gangs.dp.rank, gangs.dp.size) if gangs else (0, 1)
    counter = PerStep(CollectiveCounter())
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            SquaredErrorUnit(model), micro_batches(dp_rank, dp_size),
            torch.optim.SGD(model.parameters(), lr=0.1), output_dir=out, gangs=gangs,
            num_accumulate=NUM_ACCUMULATE, max_num_steps=NUM_STEPS, progress=False,
            publish_metrics_every_n_steps=100, validate_at_end=False,
            fsdp_reduce_every_micro_batch=reduce_every, callbacks=[counter], seed=None,
        )
        with counter.counter:
            trainer.run()
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
              for n, p in model.named_parameters()}
    names = {}
    if gangs is not None:
        shard = gangs.dp_shard or gangs.dp
        names[shard.as_process_group().group_name] = "shard"
        if gangs.dp_replicate is not None:
            names[gangs.dp_replicate.as_process_group().group_name] = "replicate"
    steps = [{(op, names.get(group, "other")): n for (op, group), n in step.items()}
             for step in counter.steps]
    return params, steps


@pytest.fixture(scope="module")
def one_process():
    return train(True)[0]


def _assert_same(params, expected):
    for name, value in expected.items():  # measured: within 3e-8 (float32 summation order)
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("reduce_every", [True, False])
def test_fsdp2_reduce_scatters_per_step_follow_the_setting(reduce_every, one_process):
    results = run_ranks(partial(train, reduce_every), world_size=2)
    expected = NUM_FSDP_GROUPS * (NUM_ACCUMULATE if reduce_every else 1)
    for params, steps in results:
        assert len(steps) == NUM_STEPS
        for step in steps:
            assert step[("_reduce_scatter_base_", "shard")] == expected, step
        _assert_same(params, one_process)


@pytest.mark.parametrize("reduce_every", [True, False])
def test_hsdp_all_reduces_across_replicas_once_per_step(reduce_every, one_process):
    results = run_ranks(partial(train, reduce_every, dp_shard_size=2), world_size=4)
    reduce_scatters = NUM_FSDP_GROUPS * (NUM_ACCUMULATE if reduce_every else 1)
    for params, steps in results:
        assert len(steps) == NUM_STEPS
        for step in steps:
            # One all-reduce of each group's gradient shard across the replicas, after the
            # last micro-batch (N per step before `set_requires_all_reduce`).
            assert step[("allreduce_", "replicate")] == NUM_FSDP_GROUPS, step
            assert step[("_reduce_scatter_base_", "shard")] == reduce_scatters, step
        _assert_same(params, one_process)
