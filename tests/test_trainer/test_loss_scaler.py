"""Semantic 2: dynamic fp16 loss scaling; an overflow on any rank skips the step on every rank
and halves the scale, a window of clean steps grows it, underflow raises naming the step."""

from __future__ import annotations

import io
import math

import pytest
import torch
from ranks import run_ranks

from gangs import FakeGang, setup_root_gang
from trainer.step.loss_scaler import LossScaler, LossScaleUnderflowError

CPU = torch.device("cpu")


def make_scaler(**kwargs) -> LossScaler:
    return LossScaler(FakeGang(), CPU, **kwargs)


def test_scale_loss():
    scaler = make_scaler(init_scale=2.0**10)
    assert scaler.scale == 1024.0
    assert scaler.scale_loss(torch.tensor(0.75)).item() == 768.0


def test_unscale_is_exact_and_in_place():
    scaler = make_scaler(init_scale=2.0**15)
    torch.manual_seed(0)
    grads = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2).half()]
    # Computed in fp32 and rounded once to the gradient's dtype, as the kernel does.
    expected = [(g.float() / 2.0**15).to(g.dtype) for g in grads]
    storages = [g.data_ptr() for g in grads]
    assert scaler.unscale_and_check(grads) is False
    assert [g.data_ptr() for g in grads] == storages
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert grads[2].dtype == torch.float16


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_overflow_detected(bad, dtype):
    scaler = make_scaler()
    grads = [torch.ones(4), torch.ones(3, dtype=dtype)]
    grads[1][2] = bad
    assert scaler.unscale_and_check(grads) is True


def test_no_gradients_is_no_overflow():
    assert make_scaler().unscale_and_check([]) is False


def test_backoff_halves_and_counts():
    scaler = make_scaler(init_scale=64.0)
    scaler.update(True, step_nr=1)
    assert scaler.scale == 32.0
    scaler.update(True, step_nr=2)
    assert scaler.scale == 16.0
    assert scaler.num_overflows == 2


def test_growth_after_exactly_growth_interval_clean_steps():
    scaler = make_scaler(init_scale=8.0, growth_interval=3)
    for step in (1, 2):
        scaler.update(False, step)
        assert scaler.scale == 8.0, f"grew early at step {step}"
    scaler.update(False, 3)
    assert scaler.scale == 16.0
    for step in (4, 5):
        scaler.update(False, step)
        assert scaler.scale == 16.0
    scaler.update(False, 6)
    assert scaler.scale == 32.0


def test_overflow_resets_the_clean_counter():
    scaler = make_scaler(init_scale=8.0, growth_interval=3)
    scaler.update(False, 1)
    scaler.update(False, 2)
    scaler.update(True, 3)  # 8 -> 4, counter back to 0
    scaler.update(False, 4)
    scaler.update(False, 5)
    assert scaler.scale == 4.0
    scaler.update(False, 6)
    assert scaler.scale == 8.0


def test_underflow_names_step_and_both_numbers():
    scaler = make_scaler(init_scale=2.0**-13, min_scale=1e-4)
    with pytest.raises(LossScaleUnderflowError) as info:
        scaler.update(True, step_nr=12)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert message.startswith("step 12:")
    assert "6.1e-05" in message and "0.0001" in message
    assert "bf16" in message


def test_scale_at_minimum_is_fine():
    scaler = make_scaler(init_scale=2.0, min_scale=1.0)
    scaler.update(True, 1)
    assert scaler.scale == 1.0


def test_default_growth_interval_scales_with_batch():
    assert make_scaler().growth_interval == 2**14
    assert make_scaler(dp_size=8).growth_interval == 2**11
    assert make_scaler(dp_size=8, num_accumulate=4).growth_interval == 2**9
    assert make_scaler(dp_size=3).growth_interval == int(2**14 / 3)
    assert make_scaler(dp_size=2**15).growth_interval == 1
    assert make_scaler(dp_size=8, growth_interval=7).growth_interval == 7


@pytest.mark.parametrize(
    "kwargs",
    [{"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        make_scaler(**kwargs)


def test_state_dict_round_trip_weights_only():
    scaler = make_scaler(init_scale=2.0**12, growth_interval=5)
    for step, overflow in enumerate([False, True, False, False], start=1):
        scaler.update(overflow, step)
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    restored = make_scaler(growth_interval=5)
    restored.load_state_dict(state)
    assert (
        restored.state_dict()
        == scaler.state_dict()
        == {
            "scale": 2048.0,
            "clean_steps": 2,
            "num_overflows": 1,
        }
    )
    for step in (5, 6, 7):  # both continue identically: growth after 3 more clean steps
        scaler.update(False, step)
        restored.update(False, step)
        assert restored.scale == scaler.scale
    assert restored.scale == 4096.0


# --- real ranks -------------------------------------------------------------------------------


def _agreement() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = setup_root_gang()
    out: dict = {}

    scaler = LossScaler(root, CPU, init_scale=2.0**8)
    grads = [torch.full((3,), 256.0), torch.full((2,), 512.0, dtype=torch.float16)]
    out["clean"] = scaler.unscale_and_check(grads)
    out["clean_grads"] = [g.tolist() for g in grads]
    scaler.update(out["clean"], 1)

    grads = [torch.ones(3), torch.ones(2, dtype=torch.float16)]
    if root.rank == 1:
        grads[1][0] = math.inf
    out["inf"] = scaler.unscale_and_check(grads)
    scaler.update(out["inf"], 2)
    out["scale"] = scaler.scale

    # Sharded gradient (DTensor, Shard(0)): the inf sits only in rank 1's shard.
    mesh = init_device_mesh("cpu", (root.size,))
    full = torch.full((4, 2), 128.0)
    full[3, 1] = math.nan
    dgrad = distribute_tensor(full, mesh, [Shard(0)])
    out["sharded"] = LossScaler(root, CPU, init_scale=2.0**7).unscale_and_check([dgrad])
    clean = distribute_tensor(torch.full((4, 2), 128.0), mesh, [Shard(0)])
    out["sharded_clean"] = LossScaler(root, CPU, init_scale=2.0**7).unscale_and_check([clean])
    out["sharded_local"] = clean.to_local().tolist()
    return out


def test_overflow_on_one_rank_is_agreed_by_all():
    results = run_ranks(_agreement, world_size=2)
    for res in results:
        assert res["clean"] is False
        assert res["clean_grads"] == [[1.0] * 3, [2.0] * 2]
        assert res["inf"] is True
        assert res["scale"] == 2.0**7
        assert res["sharded"] is True
        assert res["sharded_clean"] is False
        assert res["sharded_local"] == [[1.0, 1.0]] * 2


INJECT_STEP = 2
NUM_STEPS = 7


def _train(use_scaler: bool) -> dict:
    """Each rank trains its own copy (as with sharded parameters): an inf gradient on rank 1 at
    INJECT_STEP must make both ranks skip. Without a scaler, the reference skips that step by
    hand."""
    root = setup_root_gang()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    scaler = LossScaler(root, CPU, init_scale=2.0**10, growth_interval=3)
    data = torch.Generator().manual_seed(100 + root.rank)
    out: dict = {"overflow": [], "scale": [], "skipped_unchanged": None, "changed_after": None}

    for step in range(1, NUM_STEPS + 1):
        x = torch.randn(8, 4, generator=data)
        loss = model(x).pow(2).mean()
        before = [p.detach().clone() for p in params]
        momentum = [
            optimizer.state[p]["momentum_buffer"].clone() for p in params if p in optimizer.state
        ]
        if use_scaler:
            scaler.scale_loss(loss).backward()
            if step == INJECT_STEP and root.rank == 1:
                params[0].grad[0, 0] = math.inf
            overflow = scaler.unscale_and_check([p.grad for p in params])
        else:
            loss.backward()
            overflow = step == INJECT_STEP
        if overflow:
            optimizer.zero_grad()
        else:
            optimizer.step()
        if use_scaler:
            scaler.update(overflow, step)
        optimizer.zero_grad()

        out["overflow"].append(overflow)
        out["scale"].append(scaler.scale)
        if step == INJECT_STEP:
            out["skipped_unchanged"] = all(
                torch.equal(a, p) for a, p in zip(before, params)
            ) and all(
                torch.equal(m, optimizer.state[p]["momentum_buffer"])
                for m, p in zip(momentum, params)
            )
            out["momentum_existed"] = len(momentum) == len(params)
        if step == INJECT_STEP + 1:
            out["changed_after"] = not any(torch.equal(a, p) for a, p in zip(before, params))
    out["params"] = [p.detach().clone() for p in params]
    return out


def test_end_to_end_skip_and_grow_on_two_ranks():
    scaled = run_ranks(lambda: _train(use_scaler=True), world_size=2)
    reference = run_ranks(lambda: _train(use_scaler=False), world_size=2)
    for res, ref in zip(scaled, reference):
        assert res["overflow"] == [False, True, False, False, False, False, False]
        # 1024; halved on the overflow; the clean counter restarts, so it takes 3 clean steps
        # (3, 4, 5) to grow back, and not step 4 (which would count step 1 too).
        assert res["scale"] == [1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0]
        assert res["momentum_existed"] and res["skipped_unchanged"]
        assert res["changed_after"]
        # Scaling by powers of two is exact: same parameters as an unscaled run that skips
        # the same step.
        for p, q in zip(res["params"], ref["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    # The ranks trained on different data, so they did diverge: the skip was agreed, not copied.
    assert not torch.equal(scaled[0]["params"][0], scaled[1]["params"][0])
