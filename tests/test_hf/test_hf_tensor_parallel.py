"""Tensor parallelism of a HF model from its own plan (`model.tp_plan`): LLaMA (grouped KV
heads, untied) loaded by `load_pretrained` under DP2 x TP2 on 4 Gloo ranks trains through
the Trainer like one process, and its checkpoint exports to the trained logits."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, reference_logits, save_sharded, train_pretrained
from ranks import run_ranks
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import export_pretrained, load_pretrained
from trainer.errors import UserError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(5)
    return save_sharded(tiny_llama(), tmp_path_factory.mktemp("llama"))


def tp_logits(directory, data_parallel=None, dp_shard_size=None):
    gangs = setup_gangs(setup_root_gang(), tp_size=2, dp_shard_size=dp_shard_size)
    model = load_pretrained(directory, gangs, data_parallel=data_parallel).eval()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor) and q_proj.to_local().shape[0] == 32 // 2
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.mark.parametrize(("world_size", "data_parallel", "dp_shard_size"),
                         [(2, None, None), (4, "fsdp", 1)], ids=["tp2", "hsdp2x1_tp2"])
def test_tp_load_gives_from_pretrained_logits(llama_dir, world_size, data_parallel,
                                              dp_shard_size):
    """TP2 alone, and HSDP x TP (the 3-D mesh: 2 replicas of 1 shard, times TP2)."""
    reference = reference_logits(llama_dir)
    results = run_ranks(partial(tp_logits, llama_dir, data_parallel, dp_shard_size),
                        world_size=world_size)
    gaps = [(logits - reference).abs().max().item() for logits in results]
    print(f"{world_size} ranks, TP2 |logits - from_pretrained|: {gaps}")
    # Measured 7.5e-8: the row-parallel layers sum partial products in another order.
    assert max(gaps) <= 1e-6


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """LLaMA with `tie_word_embeddings` (as Llama 3.2 1B)."""
    config = tiny_llama().config
    config.tie_word_embeddings = True
    torch.manual_seed(6)
    return save_sharded(LlamaForCausalLM(config), tmp_path_factory.mktemp("tied"))


@pytest.mark.parametrize(("tied", "data_parallel"), [(False, "fsdp"), (True, "ddp")],
                         ids=["untied_fsdp", "tied_ddp"])
def test_dp2_tp2_trains_like_one_process_and_exports(llama_dir, tied_llama_dir, tmp_path,
                                                     tied, data_parallel):
    """"ddp" under TP is FSDP2 that keeps parameters gathered until backward."""
    directory = tied_llama_dir if tied else llama_dir
    one_losses, _ = train_pretrained(directory, tmp_path / "one", data_parallel=None)
    ranks = run_ranks(partial(train_pretrained, directory, tmp_path / "dp2tp2", tp_size=2,
                              data_parallel=data_parallel), world_size=4, timeout=300)
    losses, trained = ranks[0]
    gaps = [abs(a - b) / abs(b) for a, b in zip(losses, one_losses, strict=True)]
    print(f"DP2 x TP2 train losses {losses}\n one process {one_losses}\n relative gaps {gaps}")
    assert len(losses) == 4 and max(gaps) <= 1e-5
    exported = export_pretrained(tmp_path / "dp2tp2" / "checkpoints", tmp_path / "hf")
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(exported).eval()(INPUT_IDS).logits
    gap = (logits - trained).abs().max().item()
    print(f"|exported logits (one process) - trained logits (DP2 x TP2)|: {gap:.1e}")
    assert gap <= 1e-6


def test_a_model_without_a_plan_or_with_heads_tp_cannot_split_is_refused(tmp_path):
    gpt2 = save_sharded(tiny_gpt2(), tmp_path / "gpt2")
    config = tiny_llama().config
    config.num_key_value_heads = 1  # one KV head cannot be split over 2 TP ranks
    one_kv_head = save_sharded(LlamaForCausalLM(config), tmp_path / "mqa")

    def load():
        gangs = setup_gangs(setup_root_gang(), tp_size=2)
        with pytest.raises(UserError, match="GPT2LMHeadModel declares no tensor-parallel plan"):
            load_pretrained(gpt2, gangs)
        with pytest.raises(UserError, match="num_key_value_heads = 1 is not divisible by the "
                                            "tensor-parallel size 2"):
            load_pretrained(one_kv_head, gangs)

    run_ranks(load, world_size=2)


def test_tied_embeddings_stay_tied_under_tp(tied_llama_dir):
    """LLaMA with tied embeddings: the plan splits `embed_tokens` and `lm_head` alike (by vocabulary), so they stay one
    parameter, read once."""
    reference = reference_logits(tied_llama_dir)

    def load():
        gangs = setup_gangs(setup_root_gang(), tp_size=2)
        model = load_pretrained(tied_llama_dir, gangs, data_parallel=None).eval()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with torch.no_grad():
            return model(INPUT_IDS).logits

    gaps = [(logits - reference).abs().max().item() for logits in run_ranks(load, 2)]
    print(f"tied LLaMA under TP2: |logits - from_pretrained| {gaps}")
    assert max(gaps) <= 1e-6
