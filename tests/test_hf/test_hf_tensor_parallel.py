"""Tensor parallelism of a HF model from its own plan (`model.tp_plan`): LLaMA (grouped KV
heads, untied) loaded by `load_pretrained` under DP2 x TP2 on 4 Gloo ranks trains through
the Trainer like one process, and its checkpoint exports to the trained logits."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_models import SEQ_LEN, tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, reference_logits, save_sharded, train_pretrained
from ranks import run_ranks
from tolerances import reordered_sum_rtol
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import export_pretrained, load_pretrained
from trainer.errors import UserError

# reason: a step's loss and gradient sum its global batch's 8 x SEQ_LEN positions in float32, in
# another order per layout; tensor parallelism splits each of the 2 layers' row-parallel sums
# (<= 64 terms) in two; the clipping norm's sum adds < 32 roundings
TP_RTOL = reordered_sum_rtol(8 * SEQ_LEN + 2 * 64 + 32)
# reason: the same weights' logits, the 2 layers' row-parallel sums (<= 64 terms) and the
# head's 32 in another order: relative to the logits' scale
LOGITS_RTOL = reordered_sum_rtol(2 * 64 + 32)


def logits_gap(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """|logits - reference| as a fraction of what float32 allows (<= 1 passes)."""
    return (logits - reference).abs().max().item() / (LOGITS_RTOL * reference.abs().max().item())


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
    gaps = [logits_gap(logits, reference) for logits in results]
    print(f"{world_size} ranks, TP2 |logits - from_pretrained| (of float32's allowance): "
          f"{max(gaps):.2f}")
    assert max(gaps) <= 1


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
    # SGD with momentum, every step clipped to 0.2: linear in the gradient, so the weights
    # each step's loss is taken at are a float32 claim (AdamW moves an element whose gradient
    # is rounding noise by ~lr: tests/tolerances.py)
    options = {"sgd": True, "max_gradient_norm": 0.2}
    one_losses, _ = train_pretrained(directory, tmp_path / "one", data_parallel=None, **options)
    ranks = run_ranks(partial(train_pretrained, directory, tmp_path / "dp2tp2", tp_size=2,
                              data_parallel=data_parallel, **options), world_size=4,
                      timeout=300)
    losses, trained = ranks[0]
    # reason: a loss is a sum of positive terms: relative, at the gradient's tolerance
    gaps = [abs(a - b) / abs(b) / TP_RTOL for a, b in zip(losses, one_losses, strict=True)]
    print(f"DP2 x TP2 train losses {losses}\n one process {one_losses}\n"
          f" gaps (of float32's allowance) {max(gaps):.2f}")
    assert len(losses) == 4 and max(gaps) <= 1
    exported = export_pretrained(tmp_path / "dp2tp2" / "checkpoints", tmp_path / "hf")
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(exported).eval()(INPUT_IDS).logits
    gap = logits_gap(trained, logits)
    print(f"|exported logits (one process) - trained logits (DP2 x TP2)| (of float32's "
          f"allowance): {gap:.2f}")
    assert gap <= 1


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

    gaps = [logits_gap(logits, reference) for logits in run_ranks(load, 2)]
    print(f"tied LLaMA under TP2: |logits - from_pretrained| (of float32's allowance) "
          f"{max(gaps):.2f}")
    assert max(gaps) <= 1
