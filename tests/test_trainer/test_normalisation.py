"""Semantic 1: the step's gradient is that of the mean loss over every target of the global
batch, whatever num_accumulate, DP size and spread of targets. Checked against a
hand-written full-batch loop."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from functools import partial

import pytest
import torch
from ranks import run_ranks
from tolerances import reordered_sum_rtol, sgd_weight_atol
from toy import T, TokenUnit, collate, make_model, make_samples, reference_run

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer.observe.recorders import MetricRecorder
from trainer.trainer import Trainer

# Global micro-batches: sizes vary; samples 4 and 12 and the whole micro-batch 5 have no
# targets. Split over two ranks (`shard`), micro-batch 3 is [sample 12] on rank 0 and
# [sample 13] on rank 1: one rank without targets while the other has some.
SIZES = [4, 3, 5, 2, 4, 3, 4]
ZERO_MICRO_BATCH = 5


def global_micro_batches():
    samples = make_samples(sum(SIZES), seed=1, zero_target_ids={4, 12})
    out, i = [], 0
    for k, size in enumerate(SIZES):
        mb = samples[i : i + size]
        if k == ZERO_MICRO_BATCH:
            mb = [(x, torch.full_like(y, -1)) for x, y in mb]
        out.append(mb)
        i += size
    return out


def shard(mb, rank, dp):
    """Uneven shards: rank 0 takes the first ceil(n/2)+(n%3==0) samples."""
    if dp == 1:
        return mb
    cut = min(len(mb) - 1, (len(mb) + 1) // 2 + (len(mb) % 3 == 0))
    return mb[:cut] if rank == 0 else mb[cut:]


# AdamW with eps far above every gradient: m / (sqrt(v) + eps) is ~m / eps, linear in the
# gradient like SGD with momentum, so weights after steps are a float32 claim (at eps 1e-8 an
# element whose gradient is rounding noise moves ~lr, of either sign: tests/tolerances.py);
# its weight decay still moves weights on a step without a gradient.
EPS, LR = 1.0, 0.5
# reason: a step's gradient sums its <= 3 micro-batches' <= 3 * max(SIZES) * T token terms in
# float32, in another order per layout (micro-batches, ranks); a hidden sum of 8 terms
GRAD_RTOL = reordered_sum_rtol(3 * max(SIZES) * T + 8)


def optimizers(kind):
    return partial(torch.optim.AdamW, lr=LR, weight_decay=0.1, eps=EPS, fused=kind != "adamw")


class ListRecorder(MetricRecorder):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        self.rows.append((step_nr, dict(values)))


def run_trainer(num_accumulate, opt_kind, mean=False, host_count=False, max_norm=None,
                return_rows=False):
    root = setup_root_gang()
    gangs = setup_gangs(root)
    model = data_parallel(make_model(0), gangs)
    opt = optimizers(opt_kind)(model.parameters())
    reader = [collate(shard(mb, gangs.dp.rank, gangs.dp.size)) for mb in global_micro_batches()]
    recorder = ListRecorder()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(TokenUnit(model, mean=mean, host_count=host_count), reader, opt, output_dir=out, gangs=gangs,
                          num_accumulate=num_accumulate, max_num_data_epochs=1,
                          publish_metrics_every_n_steps=2, max_gradient_norm=max_norm,
                          progress=False, recorders=[recorder])
        result = trainer.run()
    inner = model.module if hasattr(model, "module") else model
    if return_rows:  # rank 0's train records
        return recorder.rows
    return ({k: v.detach().clone() for k, v in inner.state_dict().items()},
            result.num_steps, result.num_skipped_steps)


def reference(num_accumulate, opt_kind, mean=False, max_norm=None, curve=None):
    mbs = global_micro_batches()
    steps = [mbs[i : i + num_accumulate] for i in range(0, len(mbs), num_accumulate)]
    return reference_run(steps, optimizers(opt_kind), mean_of_means=mean, max_norm=max_norm,
                         curve=curve), len(steps)


def assert_same(params, expected):
    start, gap = make_model(0).state_dict(), 0.0
    for name, value in expected.items():
        # reason: the update is linear in the gradient (EPS), so the moves from the start
        # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
        moved = (value - start[name]).abs().max().item()
        atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, len(SIZES))
        torch.testing.assert_close(params[name], value, rtol=0, atol=atol, msg=name)
        gap = max(gap, (params[name] - value).abs().max().item() / atol)
    print(f"parameter gap (of float32's allowance): {gap:.2f}")


# A host count (an int) is known before backward: with one micro-batch in one process the
# mean is then taken by backward itself, a path of its own.
@pytest.mark.parametrize("host_count", [False, True], ids=["device_count", "host_count"])
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("num_accumulate", [1, 3])
def test_single_process_matches_full_batch_loop(num_accumulate, opt_kind, host_count):
    params, num_steps, _ = run_trainer(num_accumulate, opt_kind, host_count=host_count)
    expected, expected_steps = reference(num_accumulate, opt_kind)
    assert num_steps == expected_steps  # 7 micro-batches: with 3 a short last window of 1
    assert_same(params, expected)


@pytest.mark.parametrize("host_count", [False, True], ids=["device_count", "host_count"])
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("num_accumulate", [1, 3])
def test_two_ranks_match_full_batch_loop(num_accumulate, opt_kind, host_count):
    results = run_ranks(partial(run_trainer, num_accumulate, opt_kind, host_count=host_count),
                        world_size=2)
    expected, _ = reference(num_accumulate, opt_kind)
    for params, _, _ in results:
        assert_same(params, expected)


@pytest.mark.parametrize("host_count", [False, True], ids=["device_count", "host_count"])
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_fused"])
def test_step_without_targets_is_skipped_with_warning(opt_kind, host_count, caplog):
    # num_accumulate=1: step 6 is micro-batch 5, which has no target at all.
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        params, num_steps, skipped = run_trainer(1, opt_kind, host_count=host_count)
    assert skipped == 1 and num_steps == len(SIZES)
    assert any("no targets" in r.message for r in caplog.records)
    expected, _ = reference(1, opt_kind)
    assert_same(params, expected)
    # The reference without the skip would differ: AdamW moves weights on a zero gradient.
    mbs = global_micro_batches()
    naive = reference_run([[mb] for mb in mbs], optimizers(opt_kind), skip_empty=False)
    assert not torch.allclose(naive["2.weight"], expected["2.weight"])


def test_mean_of_means_when_unit_returns_none():
    mbs = [mb for k, mb in enumerate(global_micro_batches()) if k != ZERO_MICRO_BATCH]
    mbs = [[s for s in mb if (s[1] != -1).any()] for mb in mbs]

    root = setup_root_gang()
    gangs = setup_gangs(root)
    model = make_model(0)
    opt = optimizers("adamw")(model.parameters())
    with tempfile.TemporaryDirectory() as out:
        Trainer(TokenUnit(model, mean=True), [collate(mb) for mb in mbs], opt, output_dir=out,
                gangs=gangs, num_accumulate=3, max_num_data_epochs=1, recorders=[]).run()
    steps = [mbs[i : i + 3] for i in range(0, len(mbs), 3)]
    expected = reference_run(steps, optimizers("adamw"), mean_of_means=True)
    assert_same(model.state_dict(), expected)
    # ... and that differs from the mean over all targets, so the test can tell them apart.
    per_target = reference_run(steps, optimizers("adamw"))
    assert not torch.allclose(per_target["2.weight"], expected["2.weight"])


def _unwrapped_fails():
    gangs = setup_gangs(setup_root_gang())
    model = make_model(0)
    try:
        Trainer(TokenUnit(model), [], torch.optim.SGD(model.parameters(), lr=0.1),
                output_dir=tempfile.mkdtemp(), gangs=gangs, recorders=[])
    except ValueError as ex:
        return str(ex)
    return None


def test_unwrapped_model_with_dp_fails_at_construction():
    for msg in run_ranks(_unwrapped_fails, world_size=2):
        assert msg is not None and "data_parallel(" in msg and "2 ranks" in msg


def published(num_accumulate, opt_kind, host_count, max_norm):
    """Rank 0's train records (every 2 steps and at the end)."""
    return run_trainer(num_accumulate, opt_kind, host_count=host_count, max_norm=max_norm,
                       return_rows=True)


# The published loss is the target-weighted mean over the steps since the last publish, and
# grad_norm the norm of the last step's mean-loss gradient before clipping: both global.
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["no_clip", "clip"])
@pytest.mark.parametrize("host_count", [False, True], ids=["device_count", "host_count"])
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("num_accumulate", [1, 3])
def test_published_loss_and_grad_norm_match_the_loop(num_accumulate, opt_kind, host_count,
                                                     max_norm, world_size):
    job = partial(published, num_accumulate, opt_kind, host_count, max_norm)
    rows = job() if world_size == 1 else run_ranks(job, world_size=2)[0]
    curve: list = []
    reference(num_accumulate, opt_kind, max_norm=max_norm, curve=curve)
    assert [step for step, _ in rows] == sorted({*range(2, len(curve) + 1, 2), len(curve)})
    start, gap = 0, 0.0
    for step_nr, values in rows:
        window = curve[start:step_nr]
        loss_sum, count = sum(w[0] for w in window), sum(w[1] for w in window)
        # reason: losses and gradient norms are sums of one sign: relative, at the gradient's
        # tolerance
        expected = loss_sum / count
        assert values["loss"] == pytest.approx(expected, rel=GRAD_RTOL, abs=0), step_nr
        gap = max(gap, abs(values["loss"] / expected - 1) / GRAD_RTOL)
        assert values["num_targets"] == count
        measured = step_nr % 2 == 0 or max_norm is not None  # else no norm to publish
        assert ("grad_norm" in values) == measured, step_nr
        if measured:
            assert values["grad_norm"] == pytest.approx(window[-1][2], rel=GRAD_RTOL,
                                                        abs=0), step_nr
            if window[-1][2]:  # a skipped step's norm is 0, published as 0
                gap = max(gap, abs(values["grad_norm"] / window[-1][2] - 1) / GRAD_RTOL)
        start = step_nr
    print(f"loss/grad norm gap (of float32's allowance): {gap:.2f}")
    assert max(w[2] for w in curve) > 0.05  # the clip test clips some steps


def test_mean_seeds_stay_exact_and_bounded_when_counts_never_repeat():
    """Token counts vary from step to step without end: each seed is still exactly
    1 / count, and the cache of seeds starts over instead of growing with the run."""
    from trainer.step import gradients

    like = torch.zeros((), dtype=torch.float32)
    for count in range(1, 3000):
        seed = gradients.mean_seed(count, like)
        assert seed.item() == torch.tensor(1.0 / count, dtype=torch.float32).item(), count
        assert len(gradients._SEEDS) <= 1024  # noqa: SLF001 (the cache is the behaviour)
    assert gradients.mean_seed(0, like).item() == 1.0  # no targets: divides by 1


def test_plain_gradients_split_over_a_gang_add_up_their_squares():
    """Plain tensor gradients are replicas unless the norm is told the gangs they are split
    over (pipeline stages, each holding its layers): then each rank's share counts."""
    from gangs import FakeGang
    from trainer.step.gradients import gradient_norm, gradient_norm_parts

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    assert gradient_norm([param], None).item() == 5.0  # a replica: global already
    two_stages = FakeGang(size=2)  # each of 2 ranks holds a share like this one
    split = gradient_norm([param], None, split_over=[two_stages])
    assert split.item() == pytest.approx(5.0 * 2**0.5)
    parts = gradient_norm_parts([param], split_over=[two_stages])
    assert sum(p.item() ** 2 for p in parts) == pytest.approx(50.0)
    clipped = gradient_norm([param], 1.0, split_over=[two_stages])
    assert clipped.item() == pytest.approx(5.0 * 2**0.5)
    assert param.grad.norm().item() == pytest.approx(1.0 / 2**0.5, rel=1e-5)
