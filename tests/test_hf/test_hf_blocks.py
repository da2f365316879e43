"""FSDP2 finds the blocks of Hugging Face models (their `_no_split_modules`) and keeps GPT-2's
tied `lm_head`/`wte` weight one parameter, in the root's FSDP group, on 2 real ranks."""

from __future__ import annotations

from hf_models import tiny_gpt2, tiny_llama
from ranks import run_ranks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from gangtrain.parallel.blocks import find_blocks


def test_hf_blocks_are_found_where_each_model_keeps_them():
    gpt2, llama = tiny_gpt2(), tiny_llama()
    assert find_blocks(gpt2) == list(gpt2.transformer.h)
    assert find_blocks(llama) == list(llama.model.layers)


def _shard_gpt2():
    model = data_parallel(tiny_gpt2(), setup_gangs(setup_root_gang()), "fsdp")
    wte = model.transformer.wte.weight
    return {
        "tied": model.lm_head.weight is wte,
        "blocks_sharded": all(isinstance(b, FSDPModule) for b in model.transformer.h),
        "root_sharded": isinstance(model, FSDPModule),
        "wte_sharded": isinstance(wte, DTensor) and wte.to_local().shape[0] == wte.shape[0] // 2,
    }


def test_gpt2_fsdp_keeps_the_tied_weight_in_the_root_group():
    for rank_result in run_ranks(_shard_gpt2, world_size=2):
        assert rank_result == {"tied": True, "blocks_sharded": True, "root_sharded": True,
                               "wte_sharded": True}
