"""Same start: a Trainer whose data-parallel ranks hold different replicated weights is
refused at construction, naming the parameter; equal replicas train."""

from __future__ import annotations

import tempfile

import pytest
import torch
from ranks import run_ranks
from toy import TokenUnit, make_model, make_samples

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPTConfig
from gangtrain.parallel import data_parallel
from recipes.lm.recipe import build_model
from trainer.errors import UserError
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit


def toy_batches(rank: int) -> list:
    samples = make_samples(8, seed=3 + rank)
    return [(torch.stack([s[0] for s in samples[i:i + 2]]),
             torch.stack([s[1] for s in samples[i:i + 2]])) for i in range(0, 8, 2)]


def construct(model, unit, reader, gangs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(unit, reader, optimizer, output_dir=tempfile.mkdtemp(), gangs=gangs,
                   max_num_steps=2, recorders=[], progress=False)


def ddp_run(perturb: bool) -> str:
    """DDP broadcasts rank 0's weights when it wraps; rank 1 then changes one (as a rank that
    loads its own checkpoint after wrapping would)."""
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(0), gangs)
    if perturb and gangs.root.rank == 1:
        with torch.no_grad():
            model.module[2].bias[3] += 1e-6
    try:
        trainer = construct(model, TokenUnit(model), toy_batches(gangs.root.rank), gangs)
    except UserError as error:
        return str(error)
    return f"ran {trainer.run().num_steps} steps"


def test_a_perturbed_replicated_weight_is_refused_naming_it():
    for message in run_ranks(lambda: ddp_run(perturb=True), 2):
        assert message.startswith("parameter 'module.2.bias' differs between the "
                                  "data-parallel ranks"), message


def test_equal_replicas_train():
    assert run_ranks(lambda: ddp_run(perturb=False), 2) == ["ran 2 steps"] * 2


CONFIG = GPTConfig(seq_len=8, dim=16, num_layers=2, num_heads=2, vocab_size=37)


def hsdp_run(perturb_rank: int | None, dp_shard_size: int | None) -> str:
    """Under HSDP, ranks 0 and 2 (1 and 3) hold the same shards: a replica group."""
    gangs = setup_gangs(setup_root_gang(), dp_shard_size=dp_shard_size)
    model = build_model(CONFIG, gangs, "fsdp", seed=1)
    if gangs.root.rank == perturb_rank:
        with torch.no_grad():
            model.layers[1].attention.wq.weight.to_local()[0, 0] += 1e-6
    ids = torch.randint(0, 37, (4, 9), generator=torch.Generator().manual_seed(gangs.dp.rank))
    reader = [{"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}] * 2
    try:
        trainer = construct(model, CausalLMUnit(model), reader, gangs)
    except UserError as error:
        return str(error)
    return f"ran {trainer.run().num_steps} steps"


@pytest.mark.parametrize("perturb_rank", [0, 3])
def test_hsdp_replica_groups_must_hold_the_same_shards(perturb_rank):
    for message in run_ranks(lambda: hsdp_run(perturb_rank, dp_shard_size=2), 4):
        assert message.startswith("parameter 'layers.1.attention.wq.weight' differs"), message


def test_hsdp_and_fsdp_shards_train():
    assert run_ranks(lambda: hsdp_run(None, dp_shard_size=2), 4) == ["ran 2 steps"] * 4
    # Plain FSDP2: every rank holds its own shards, nothing to compare.
    assert run_ranks(lambda: hsdp_run(3, dp_shard_size=None), 4) == ["ran 2 steps"] * 4
