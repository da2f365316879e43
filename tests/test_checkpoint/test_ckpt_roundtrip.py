import pytest
import torch
from ranks import run_ranks

from gangs import FakeGang, setup_gangs, setup_root_gang
from trainer.checkpoint import CheckpointManager, export_model
from trainer.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(width=8, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))


def _train(model, optim, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(6, 4, generator=g)).pow(2).sum().backward()
        optim.step()


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optim_state(optim):
    sd = optim.state_dict()
    return {
        "state": {k: {n: t.clone() for n, t in s.items()} for k, s in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _rank_state(rank):
    return {"step": 3, "rank": rank, "rng": torch.arange(5) * (rank + 1), "reader": {"pos": [rank, 7]},
            "scale": 1.5, "name": "x", "flag": True, "none": None}


def test_round_trip_single_process(tmp_path):
    gangs = setup_gangs(FakeGang())
    model = _model()
    optim = _optim(model)
    _train(model, optim)
    mgr = CheckpointManager(tmp_path, gangs)
    mgr.save(3, model, optim, _rank_state(0))

    fresh = _model(seed=42)
    fresh_optim = _optim(fresh)
    assert mgr.find_latest() == 3
    rank_state = mgr.load(3, fresh, fresh_optim)
    _assert_same(_params(fresh), _params(model))
    _assert_same(_optim_state(fresh_optim), _optim_state(optim))
    _assert_same(rank_state, _rank_state(0))
    assert "resharded" not in rank_state

    # Training on from the loaded state stays bit-identical.
    _train(model, optim, seed=5)
    _train(fresh, fresh_optim, seed=5)
    _assert_same(_params(fresh), _params(model))
    mgr.close()


def test_model_only_and_shape_mismatch(tmp_path):
    gangs = setup_gangs(FakeGang())
    model = _model()
    mgr = CheckpointManager(tmp_path, gangs)
    mgr.save(1, model, None, {})
    fresh = _model(seed=3)
    mgr.load(1, fresh, None)
    _assert_same(_params(fresh), _params(model))

    with pytest.raises(UserError, match=r"step_1.*'0\.weight' has shape \(8, 4\) in the "
                                        r"checkpoint and \(9, 4\)"):
        mgr.load(1, _model(width=9), None)
    with pytest.raises(UserError, match=r"step_1 does not fit the model or optimizer: "
                                        r"Missing key .*optimizer\.state\.0\.weight"):
        mgr.load(1, fresh, _optim(fresh))  # saved without an optimizer
    wider = torch.nn.Sequential(_model(), torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="step_1 has no entry for model parameter '0.0.weight'"):
        mgr.load(1, wider, None)
    mgr.close()


def test_rank_state_must_be_plain_data(tmp_path):
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    with pytest.raises(TypeError, match=r"rank_state\['reader'\]\['obj'\] is a object"):
        mgr.save(1, _model(), None, {"reader": {"obj": object()}})
    mgr.close()


def _ddp_save_and_load(ckpt_dir):
    def fn():
        gangs = setup_gangs(setup_root_gang(device="cpu"))
        rank = gangs.root.rank
        ddp = torch.nn.parallel.DistributedDataParallel(
            _model(), process_group=gangs.dp.as_process_group()
        )
        optim = _optim(ddp)
        _train(ddp, optim, seed=10 + rank)  # different data per rank, DDP averages grads
        mgr = CheckpointManager(ckpt_dir, gangs)
        mgr.save(3, ddp, optim, _rank_state(rank))

        fresh = torch.nn.parallel.DistributedDataParallel(
            _model(seed=7), process_group=gangs.dp.as_process_group()
        )
        fresh_optim = _optim(fresh)
        step = mgr.find_latest()
        rank_state = mgr.load(step, fresh, fresh_optim)
        _assert_same(_params(fresh.module), _params(ddp.module))
        _assert_same(_optim_state(fresh_optim), _optim_state(optim))
        mgr.close()
        return {
            "step": step,
            "params": _params(ddp.module),
            "optim": _optim_state(optim),
            "rank_state": rank_state,
        }

    return fn


def test_ddp_two_ranks_then_reshard_to_one_process(tmp_path):
    results = run_ranks(_ddp_save_and_load(tmp_path), world_size=2)
    assert [r["step"] for r in results] == [3, 3]
    _assert_same(results[0]["params"], results[1]["params"])
    _assert_same(results[0]["optim"], results[1]["optim"])
    for rank in (0, 1):
        _assert_same(results[rank]["rank_state"], _rank_state(rank))

    manifest = CheckpointManager(tmp_path, setup_gangs(FakeGang())).manifest(3)
    assert manifest["world_size"] == 2 and manifest["gangs"] == {"dp": 2, "tp": 1, "ep": 1}
    assert "rank_1.pt" in manifest["files"]

    # Load the 2-rank checkpoint in one process: same parameters (no "module." prefix), and
    # rank 0's state, flagged as resharded because the world size changed.
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    plain = _model(seed=9)
    optim = _optim(plain)
    rank_state = mgr.load(mgr.find_latest(), plain, optim)
    _assert_same(_params(plain), results[0]["params"])
    _assert_same(_optim_state(optim), results[0]["optim"])
    assert rank_state.pop("resharded") is True
    _assert_same(rank_state, _rank_state(0))
    mgr.close()

    exported = torch.load(export_model(tmp_path, tmp_path / "m.pt"), weights_only=True)
    _assert_same(exported, results[0]["params"])


def test_one_process_checkpoint_loads_on_two_ranks(tmp_path):
    model = _model()
    optim = _optim(model)
    _train(model, optim)
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    mgr.save(3, model, optim, _rank_state(0))
    mgr.close()

    def fn():
        gangs = setup_gangs(setup_root_gang(device="cpu"))
        ddp = torch.nn.parallel.DistributedDataParallel(
            _model(seed=5), process_group=gangs.dp.as_process_group()
        )
        fresh_optim = _optim(ddp)
        mgr = CheckpointManager(tmp_path, gangs)
        rank_state = mgr.load(mgr.find_latest(), ddp, fresh_optim)
        mgr.close()
        return _params(ddp.module), _optim_state(fresh_optim), rank_state

    for params, optim_state, rank_state in run_ranks(fn, world_size=2):
        _assert_same(params, _params(model))
        _assert_same(optim_state, _optim_state(optim))
        assert rank_state.pop("resharded") is True  # rank 1 gets rank 0's state too
        _assert_same(rank_state, _rank_state(0))


def test_fsdp2_async_save_loads_in_one_process(tmp_path):
    """FSDP2 shards parameters and optimizer state as DTensors over dp: an async save
    stages the local shards, and one process loads the full tensors back."""

    def fn():
        from torch.distributed.fsdp import fully_shard

        gangs = setup_gangs(setup_root_gang(device="cpu"))
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=gangs.mesh["dp"])
        fully_shard(model, mesh=gangs.mesh["dp"])
        optim = _optim(model)
        _train(model, optim, seed=20 + gangs.root.rank)
        mgr = CheckpointManager(tmp_path, gangs, async_save=True)
        mgr.save(3, model, optim, _rank_state(gangs.root.rank))
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        _train(model, optim, seed=30)  # mutates the shards while the writer runs
        mgr.close()
        return full

    full = run_ranks(fn, world_size=2)[0]
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    plain = _model(seed=9)
    rank_state = mgr.load(mgr.find_latest(), plain, _optim(plain))
    _assert_same(_params(plain), full)
    assert rank_state["resharded"] is True
    mgr.close()
