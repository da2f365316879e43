"""The mixture-of-experts layer: routing, counts and load-balancing loss in one process; and
expert-parallel training on real Gloo ranks (all_to_all dispatch, expert gradients reduced
over expert_dp) matching the single-process run: loss curve, final parameters (experts
gathered through `full_tensor()`) and per-expert token counts."""

from __future__ import annotations

from functools import cache, partial

import pytest
import torch
import torch.nn.functional as F
from lm_batches import padded_lm_batches
from ranks import run_ranks
from tolerances import reordered_sum_rtol, sgd_weight_atol
from torch.distributed.tensor import DTensor

from gangs import ReduceOperation, setup_gangs, setup_root_gang
from gangtrain.layers.moe import MoEFeedForward, moe_aux_loss, moe_layers
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import parallelize_gpt
from gangtrain.parallel import param_groups, reduce_expert_gradients
from gangtrain.parallel.expert import ddp_ignored_names
from trainer.step.gradients import global_target_count, scale_gradients
from units.causal_lm import CausalLMUnit, lm_loss

CONFIG = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4, num_experts=4, top_k=2)
NUM_STEPS, BATCH = 4, 4
# AdamW with eps above the gradients: m / (sqrt(v) + eps) is ~m / eps, its change with the
# gradient at most lr / eps, like SGD with momentum, so the layouts' weights are a float32
# claim (at eps 1e-8, an element whose gradient is float32 rounding moves ~lr, of either
# sign: tests/tolerances.py). lr * weight decay ~1e-3, as before.
EPS, LR, WEIGHT_DECAY = 1.0, 0.3, 3e-3  # weights move ~0.05 in 4 steps, AdamW lr 1e-2's ~0.04
# reason: a step's gradient sums its batch's positions in float32, in another order per
# layout; each token sums its top_k experts' outputs, tensor parallelism each layer's hidden
# sums, in other orders
GRAD_RTOL = reordered_sum_rtol(BATCH * CONFIG.seq_len + CONFIG.top_k
                               + CONFIG.num_layers * CONFIG.dim)


# -- one process ------------------------------------------------------------------------
def test_output_is_the_gate_weighted_sum_of_the_top_k_experts() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=8, hidden_dim=16, num_experts=4, top_k=2)
    x = torch.randn(3, 5, 8)
    y = moe(x)
    tokens = x.reshape(-1, 8)
    probs = (tokens @ moe.router.weight.t()).softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    w1, w2 = moe.experts.w1, moe.experts.w2
    expected = torch.stack([
        sum(gates[t, j] * (w2[e] @ F.gelu(w1[e] @ tokens[t])) for j, e in enumerate(idx[t]))
        for t in range(tokens.shape[0])
    ])
    torch.testing.assert_close(y.reshape(-1, 8), expected, rtol=1e-5, atol=1e-6)

    # Counts: global expert index, accumulated in training mode until reset.
    assert moe.tokens_per_expert.tolist() == torch.bincount(idx.flatten(), minlength=4).tolist()
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 2 * 15 * 2
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 2 * 15 * 2
    moe.reset_tokens_per_expert()
    assert moe.tokens_per_expert.sum().item() == 0

    # Switch load balancing: num_experts * sum_e f_e * P_e, differentiable through P.
    f = torch.bincount(idx.flatten(), minlength=4).float() / (15 * 2)
    torch.testing.assert_close(moe.aux_loss, 4 * (f * probs.mean(0)).sum())
    moe.aux_loss.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_empty_batch() -> None:
    moe = MoEFeedForward(dim=8, hidden_dim=16, num_experts=4, top_k=2)
    assert moe(torch.zeros(0, 16, 8)).shape == (0, 16, 8)
    assert moe.aux_loss.item() == 0.0


def test_gpt_with_experts_and_what_ddp_ignores() -> None:
    model = GPT(CONFIG)
    assert moe_aux_loss(model) is None
    model(torch.randint(0, 256, (2, 16)))
    assert moe_aux_loss(model) is not None and [n for n, _ in moe_layers(model)] == [
        "layers.0.feed_forward", "layers.1.feed_forward"]
    assert ddp_ignored_names(model) == [
        "layers.0.feed_forward.experts.w1", "layers.0.feed_forward.experts.w2",
        "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2",
        "layers.0.feed_forward.tokens_per_expert", "layers.1.feed_forward.tokens_per_expert",
    ]


# -- expert parallelism on real ranks -----------------------------------------------------
def global_batches() -> list[dict[str, torch.Tensor]]:
    return padded_lm_batches(NUM_STEPS, BATCH, CONFIG.seq_len, CONFIG.vocab_size, seed=3)


def train(ep_size: int = 1, data_parallel: str = "ddp", tp_size: int = 1):
    """The trainer's step written out, with `reduce_expert_gradients` where the trainer hook
    goes: after backward, before the normalisation by dp_size / global target count."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, ep_size=ep_size)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(CONFIG, ep_gang=gangs.ep), gangs, data_parallel=data_parallel)
    inner = getattr(model, "module", model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                            fused=True)
    dp, rank = gangs.dp.size, gangs.dp.rank
    curve = []
    for batch in global_batches():
        loss, num_targets = lm_loss(model, {k: v[rank::dp] for k, v in batch.items()}, -100)
        loss.backward()
        reduce_expert_gradients(model, gangs)
        count = global_target_count(num_targets, gangs.dp, gangs.device)
        scale_gradients([p.grad for p in params], dp, count)
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1)
        gangs.dp.all_reduce(total, ReduceOperation.SUM)
        curve.append((total / count).item())
    counts = torch.stack([m.tokens_per_expert for _, m in moe_layers(inner)])
    gangs.dp.all_reduce(counts, ReduceOperation.SUM)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in inner.named_parameters()}
    return curve, full, counts


@cache
def reference():
    return train()


def start_parameters() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in GPT(CONFIG).named_parameters()}


def assert_parameters_match(params, ref_params) -> float:
    """The largest parameter gap, as a fraction of what float32 allows."""
    start, gap = start_parameters(), 0.0
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        # reason: the update's change is linear in the gradient's (EPS): the moves from the
        # start differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
        moved = (value - start[name]).abs().max().item()
        atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, NUM_STEPS)
        torch.testing.assert_close(params[name], value, rtol=0, atol=atol, msg=name)
        gap = max(gap, (params[name] - value).abs().max().item() / atol)
    return gap


@pytest.mark.parametrize(
    ("world_size", "ep_size", "data_parallel", "tp_size"),
    [
        pytest.param(2, 2, "ddp", 1, id="ep2-ddp"),
        pytest.param(2, 2, "fsdp", 1, id="ep2-fsdp2"),
        pytest.param(2, 1, "ddp", 1, id="dp2-moe"),
        pytest.param(4, 2, "ddp", 1, id="dp4-ep2"),  # expert_dp of 2: experts reduced over it
        pytest.param(4, 2, "fsdp", 2, id="dp2-ep2-tp2"),  # MoE replicated over TP
    ],
)
def test_expert_parallel_matches_single_process(world_size, ep_size, data_parallel, tp_size):
    results = run_ranks(partial(train, ep_size, data_parallel, tp_size), world_size=world_size)
    ref_curve, ref_params, ref_counts = reference()
    curve_gap = param_gap = 0.0
    for curve, params, counts in results:
        # reason: a loss sums its positions' positive token losses: relative, at the
        # gradient's tolerance (the weights it is taken at differ by that)
        torch.testing.assert_close(torch.tensor(curve), torch.tensor(ref_curve),
                                   rtol=GRAD_RTOL, atol=0)
        assert torch.equal(counts, ref_counts)
        param_gap = max(param_gap, assert_parameters_match(params, ref_params))
        curve_gap = max([curve_gap] + [abs(a / b - 1) / GRAD_RTOL
                                       for a, b in zip(curve, ref_curve)])
    print(f"gaps (of float32's allowance): loss {curve_gap:.2f}, parameters {param_gap:.2f}")


# -- the same through the Trainer -----------------------------------------------------------
def train_with_trainer(ep_size: int, data_parallel: str):
    """The Trainer's own expert-parallel path (its `reduce_expert_gradients` hook, its
    normalisation) on the batches `train` uses."""
    import tempfile

    from trainer.trainer import Trainer
    from units import TrainUnit

    gangs = setup_gangs(setup_root_gang(), ep_size=ep_size)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(CONFIG, ep_gang=gangs.ep), gangs, data_parallel=data_parallel)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                            fused=True)
    dp, rank = gangs.dp.size, gangs.dp.rank

    class ShardUnit(TrainUnit):
        @property
        def model(self):
            return model

        def __call__(self, batch, metrics):
            return lm_loss(model, batch, -100)

    # Each rank its rows of every global batch (the Trainer refuses one list that every DP
    # rank holds whole).
    shards = [{k: v[rank::dp] for k, v in b.items()} for b in global_batches()]
    Trainer(ShardUnit(), shards, opt, output_dir=tempfile.mkdtemp(), gangs=gangs,
            recorders=[], max_num_steps=NUM_STEPS, seed=None).run()
    inner = getattr(model, "module", model)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in inner.named_parameters()}


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_the_trainers_expert_parallel_path_matches_single_process(data_parallel):
    results = run_ranks(partial(train_with_trainer, 2, data_parallel), world_size=2)
    _, ref_params, _ = reference()
    for params in results:
        assert_parameters_match(params, ref_params)


# -- the load-balancing loss on several ranks --------------------------------------------
def unit_on_gpt_built_by_hand():
    """A CausalLMUnit adding the MoE aux loss of a GPT built without the recipe's
    `build_model` (which names the data gangs): the refusal's text."""
    setup_gangs(setup_root_gang())
    with pytest.raises(ValueError) as error:
        CausalLMUnit(GPT(CONFIG), moe_aux_loss_weight=0.01)
    return str(error.value)


def test_a_moe_on_several_ranks_that_names_no_data_gangs_is_refused():
    """Each rank's tokens alone, silently, is what the global rule is there to prevent
    (tests/test_recipes/test_recipe_lm_pp_cp.py: the recipe's EP2 and CP2 equal one process)."""
    message = run_ranks(unit_on_gpt_built_by_hand, world_size=2)[0]
    assert "GPT: its MoE layers' load-balancing loss (moe_aux_loss_weight > 0) and it runs " \
           "on several ranks without knowing which hold other tokens" in message, message
    assert "share_router_statistics(model, [gangs.dp, gangs.cp])" in message
