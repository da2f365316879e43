"""torchft replica groups on CPU/Gloo, through the Trainer: 3 groups of 1 process; one is
SIGKILLed mid-run and restarted; the others train on without a restart; the restarted one
recovers live and rejoins; every sample is trained once in a committed step; and a run
without failure equals today's DDP run over 3 ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gangtrain[ft]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package
from ranks import run_ranks  # noqa: E402

from benchmarks.fault_tolerance import (  # noqa: E402
    GLOBAL_BATCH,
    Regression,
    Rows,
    global_batch,
    make_model,
    make_optimizer,
    run,
)

STEPS = 16


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The 3 groups with no failure."""
    return run(tmp_path_factory.mktemp("clean"), STEPS)


def relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """|got - expected| / |expected| over every parameter of the model together."""
    diff = sum(float((got[k] - v).double().square().sum()) for k, v in expected.items())
    norm = sum(float(v.double().square().sum()) for v in expected.values())
    return (diff / norm) ** 0.5


# float32 gradients of other shares (4 or 6 samples a group, DDP's ring or our float64 sum)
# round differently by ~1 ulp (6e-8) a step; through 16 SGD steps with momentum the model
# moved by measured 1-3e-7 relative (both comparisons below), so 1e-6 has 3-10x margin.
TOLERANCE = 1e-6


def assert_each_sample_once(committed: dict[int, list[list[int]]]) -> None:
    """Every step 1..STEPS: the ids the groups trained in it, together, are its global batch,
    each once (none twice, none lost)."""
    assert sorted(committed) == list(range(1, STEPS + 1))
    for step_nr, shares in committed.items():
        trained = sorted(i for share in shares for i in share)
        assert trained == sorted(global_batch(step_nr)), step_nr
        assert len(trained) == GLOBAL_BATCH


@pytest.mark.parametrize("group_size", [1, 2])  # processes a group: 2 is DDP inside it
def test_a_killed_replica_group_fault_is_survived_and_the_group_rejoins_live(
        tmp_path, clean_run, group_size):
    result = run(tmp_path, STEPS, kill_at=4, group_size=group_size)
    # The healthy groups never exited; each undid exactly the step the failure broke.
    assert result.healthy_exit_codes == [0] * 2 * group_size
    assert [result.finals[i]["uncommitted"] for i in (0, 1)] == [1, 1]
    # The restarted group received the weights live (its init sync at step 0 aside).
    assert result.finals[2]["healed"] >= 1 and result.finals[2]["step"] == STEPS
    # Steps 4-6 were trained by the 2 live groups (half the batch each, step 4 drawn
    # again); the last ones by all 3 again.
    ranks = 2 * group_size
    for step_nr in (4, 5, 6):
        shares = sorted(len(share) for share in result.committed[step_nr])
        assert shares == [GLOBAL_BATCH // ranks] * ranks, step_nr
    assert all(len(result.committed[s]) == 3 * group_size for s in range(STEPS, STEPS - 3, -1))
    assert_each_sample_once(result.committed)
    # Every group holds the same weights, bit for bit: each applied the same summed gradient.
    params = [result.finals[i]["params"] for i in range(3)]
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name
        assert torch.equal(params[0][name], params[2][name]), name
    # The same global batches committed: the run without the failure, up to rounding.
    assert relative_difference(params[0], clean_run.finals[0]["params"]) < TOLERANCE


def _ddp_reference(out: str) -> dict[str, torch.Tensor]:
    """Today's run: one job, DDP over 3 ranks, each rank its slice of the same batches."""
    import torch.distributed as dist

    from gangs import setup_gangs, setup_root_gang
    from gangtrain.parallel import data_parallel
    from trainer import Trainer

    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs, "ddp")
    unit = Regression(model)
    Trainer(unit, Rows(dist.get_rank(), 3), make_optimizer(model), gangs=gangs,
            output_dir=Path(out) / "ddp", max_num_steps=STEPS, recorders=[], progress=False,
            num_threads=1).run()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_replica_groups_without_fault_equal_the_ddp_run(tmp_path, clean_run):
    assert_each_sample_once(clean_run.committed)
    assert all(len(shares) == 3 for shares in clean_run.committed.values())
    reference = run_ranks(lambda: _ddp_reference(str(tmp_path)), world_size=3)[0]
    assert relative_difference(clean_run.finals[0]["params"], reference) < TOLERANCE
