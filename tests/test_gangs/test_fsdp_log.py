"""`fully_shard_model` says once, at INFO on rank 0, which blocks got an FSDP2 group."""

from __future__ import annotations

import logging

from ranks import run_ranks
from test_fsdp_blocks import Stack

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import fully_shard_model


def _shard_and_log() -> list[tuple[str, str]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("gangtrain")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    gangs = setup_gangs(setup_root_gang("cpu"))
    fully_shard_model(Stack(), gangs)
    fully_shard_model(Stack(tie_first_block=True), gangs)
    return [(r.levelname, r.getMessage()) for r in records
            if r.getMessage().startswith("FSDP2")]


def test_the_blocks_fsdp2_wrapped_are_logged_once_at_info():
    on_rank0, on_rank1 = run_ranks(_shard_and_log, world_size=2)
    assert on_rank0 == [
        ("INFO", "FSDP2 sharded 3 block(s) one group each (3 x Block: trunk.h.0 .. trunk.h.2), "
                 "the rest (embeddings, norms, output and tied weights) with the root Stack"),
        # The block holding a tied weight is left to the root, with the weight's other use.
        ("INFO", "FSDP2 sharded 2 block(s) one group each (2 x Block: trunk.h.1 .. trunk.h.2), "
                 "the rest (embeddings, norms, output and tied weights) with the root Stack"),
    ]
    assert on_rank1 == []
