"""Pipeline parallelism on 2 Gloo ranks, by hand (the Trainer's path for the GPT is
test_pipeline_trainer.py): 1F1B and ZBV zero-bubble train a HF Llama exactly as one process does
(losses, gradient norms, final weights over 30 steps of 4 micro-batches), with the gradient
normalised by the step's target count (summed losses, scale_grads=False); stage splits by
count and by boundaries keep whole-model names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from tolerances import assert_sgd_weights_close, reordered_sum_rtol

from gangs import ProcessGroupGang
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.spec import GPT_SPEC
from gangtrain.models.hf import spec_for
from gangtrain.parallel.gradient_norm import gradient_norm
from gangtrain.parallel.pipeline import available_schedules, pipeline_model
from gangtrain.parallel.pipeline_stages import build_stage, layer_split, merge_stages

VOCAB, SEQ, MICRO, ACC, STEPS = 64, 16, 2, 4, 30
MAX_NORM = 0.5
# AdamW with eps far above every gradient (clipped to a norm of 0.5): m / (sqrt(v) + eps) is
# ~m / eps, linear in the gradient like SGD with momentum, so the weights after 30 steps are a
# float32 claim (at eps 1e-8 an element whose gradient is rounding noise moves ~lr a step, of
# either sign: tests/tolerances.py).
EPS, LR = 1.0, 1.0
# reason: a step's gradient sums its 128 positions' terms in float32, accumulated by
# micro-batch in another order per schedule (split backward, stages' sums); the clipping
# norm's sum over two stages adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(ACC * MICRO * SEQ + 32)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, num_layers=4, num_heads=2,
                         tie_embeddings=False))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa"))


def logits_of(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction="sum")


def step_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's ACC micro-batches, concatenated; some targets ignored (uneven counts)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ACC * MICRO, SEQ + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    return ids[:, :-1], targets


def reference(build) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, by hand: summed losses, divided by the step's target count, clipped."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = step_batches(step)
        total = 0.0
        for i in range(ACC):
            rows = slice(i * MICRO, (i + 1) * MICRO)
            loss = summed_loss(logits_of(model(inputs[rows])), targets[rows])
            loss.backward()
            total += loss.item()
        count = (targets != -100).sum().item()
        for p in model.parameters():
            p.grad /= count
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        losses.append(total / count)
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined(build, schedule: str):
    spec = spec_for(build()) if build is llama else GPT_SPEC

    def rank_fn():
        pipe = pipeline_model(build(), dist.group.WORLD, spec=spec, loss_fn=summed_loss,
                              num_microbatches=ACC, schedule=schedule)
        params = list(pipe.model.parameters())
        stages = ProcessGroupGang(dist.group.WORLD, torch.device("cpu"))
        optimizer = torch.optim.AdamW(params, lr=LR, eps=EPS)
        losses, norms = [], []
        for step in range(STEPS):
            inputs, targets = step_batches(step)
            positions = torch.arange(inputs.shape[1]).expand_as(inputs)
            loss = pipe.step((inputs, positions), targets)
            count = (targets != -100).sum()
            torch._foreach_div_([p.grad for p in params], count.float())
            norms.append(gradient_norm(params, MAX_NORM, split_over=[stages]).item())
            losses.append((loss / count).item())
            optimizer.step()
            optimizer.zero_grad()
        return losses, norms, {n: p.detach().clone() for n, p in pipe.model.named_parameters()}

    return run_ranks(rank_fn, world_size=2, timeout=300)


MODELS = {"gpt": gpt, "llama": llama}
_REFERENCES: dict[str, tuple] = {}


# Through HF's modules a step costs 5-10x the GPT's: two schedules here, one stage a rank
# and two in a V with split backward; the GPT runs every schedule through the Trainer.
@pytest.mark.parametrize("schedule", [s for s in available_schedules()
                                      if s in ("1f1b", "zbv_zero_bubble")])
@pytest.mark.parametrize("family", ["llama"])
def test_pp2_trains_like_one_process(family, schedule):
    if family not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the ranks: two threads make these small ops slower
        try:
            _REFERENCES[family] = reference(MODELS[family])
        finally:
            torch.set_num_threads(threads)
    ref_losses, ref_norms, ref_params = _REFERENCES[family]
    results = pipelined(MODELS[family], schedule)
    start = dict(MODELS[family]().named_parameters())
    curve_gap = param_gap = 0.0
    for losses, norms, _ in results:  # every pp rank agrees on the loss and the norm
        # reason: losses and gradient norms are sums of one sign: relative, at the
        # gradient's tolerance
        for step in range(STEPS):
            for got, ref in ((losses[step], ref_losses[step]), (norms[step], ref_norms[step])):
                assert abs(got / ref - 1) <= GRAD_RTOL, (step, losses, ref_losses, norms)
                curve_gap = max(curve_gap, abs(got / ref - 1) / GRAD_RTOL)
    names = [set(params) for _, _, params in results]
    assert not names[0] & names[1] and names[0] | names[1] == set(ref_params)
    for _, _, params in results:
        for name, value in params.items():
            ref = ref_params[name]
            # reason: the update is linear in the gradient (EPS), so the moves from the start
            # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
            param_gap = max(param_gap, assert_sgd_weights_close(
                value, ref, start[name], GRAD_RTOL, STEPS, name))
    print(f"gaps (of float32's allowance): loss/grad norm {curve_gap:.2f}, "
          f"parameters {param_gap:.2f}")


def test_layer_split_by_count_and_by_boundaries():
    assert layer_split(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert layer_split(8, 2, boundaries=[3]) == [range(0, 3), range(3, 8)]
    for bad in ([0], [8], [5, 3]):
        with pytest.raises(ValueError, match="pipeline.boundaries"):
            layer_split(8, 2 if len(bad) == 1 else 3, boundaries=bad)
    with pytest.raises(ValueError, match="4 layers cannot fill 8 stages"):
        layer_split(4, 8)


def test_stages_keep_whole_model_names_and_refuse_tied_embeddings():
    model = gpt()
    split = layer_split(4, 4)
    merged = merge_stages([build_stage(GPT_SPEC, model, split, i) for i in (0, 2)])
    names = {n for n, _ in merged.named_parameters()}
    assert "tok_embeddings.weight" in names and "layers.2.attention.wq.weight" in names
    assert not any(n.startswith(("layers.1.", "layers.3.", "output")) for n in names)
    torch.manual_seed(0)
    tied = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, num_layers=4, num_heads=2))
    with pytest.raises(ValueError, match="tie_embeddings=false"):
        build_stage(GPT_SPEC, tied, split, 0)
