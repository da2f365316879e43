"""Steps lost to one failure: torchft replica groups against a full restart from a checkpoint.

    .venv/bin/python -m benchmarks.fault_tolerance [--steps 24] [--kill-at 9] [--every 5]
    .venv/bin/python -m benchmarks.fault_tolerance --recipe sft [--steps 16] [--kill-at 6]

Three replica groups of one process each (CPU, Gloo) train a small regression through the
Trainer, meeting over a torchft lighthouse. Group 2 is SIGKILLed at the start of step
`--kill-at` and restarted at once; it recovers live from a healthy peer and rejoins. Printed:
the steps the healthy groups had to do again (their uncommitted steps: 0-1), whether any
healthy process exited (none may), whether every group ends with the same weights, the
wall time against the same run without the failure; and, measured the same way, what a job
without torchft loses to the same failure: one DDP job over 3 processes checkpointing every
`--every` steps, rank 2 killed at the same step, every process stopped and restarted from
the newest checkpoint (as torchrun's agent does): the steps trained twice on every rank
(`kill_at - 1 - last checkpoint`) and its wall time. Timings on a shared machine are noisy;
the step counts are exact.

`--recipe sft`: the same failure in a real recipe: three `python -m recipes.sft` groups of
one process (a tiny chat model made here), group 0 (the local lighthouse's owner) and then
group 1 SIGKILLed at step `--kill-at` and started again with the same command
(`benchmarks.ft_recipe`): the steps each healthy group did again, the exit codes, whether
every group ends with the same weights, and the wall time against the run without a failure.

The run's parts (a tiny regression, its sample-id-carrying reader, the processes of the
groups and the lighthouse, forked from this one) are also what tests/test_fault drives.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gangtrain.data.global_batches import GlobalBatchReader
from trainer import Callback, Trainer
from units import MetricBag, TrainUnit

NUM_SAMPLES, GLOBAL_BATCH, SEED = 96, 12, 5


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(NUM_SAMPLES, 3, generator=torch.Generator().manual_seed(0))
    return x, torch.sin(x @ torch.tensor([1.0, -2.0, 0.5]))


class Rows(GlobalBatchReader):
    """Shuffled global batches of 12 rows; each batch carries its sample ids."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.x, self.y = samples()
        super().__init__(NUM_SAMPLES, GLOBAL_BATCH, dp_rank, dp_size, seed=SEED)

    def make_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.x[indices], self.y[indices], indices


class Regression(TrainUnit):
    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.ids: list[int] = []  # the samples of the step under way

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: Any, metrics: MetricBag) -> tuple[torch.Tensor, int]:
        x, y, ids = batch
        self.ids = ids.tolist()
        return F.mse_loss(self._model(x).squeeze(-1), y, reduction="sum"), y.numel()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # a state to recover


@dataclass
class GroupPlan:
    out: Path
    replica_id: int
    lighthouse: str
    steps: int
    kill_at: int | None = None  # SIGKILL itself at the start of this step's forward
    wait_for: int = 0  # started groups to wait for before training (all at the start)
    slow_until_rejoined: bool = False  # healthy groups: slow until the killed one is back
    hold_at: int | None = None  # and from this step on, wait for its restart to heartbeat
    restarted: bool = False  # the killed group's new process: says when it is back
    rank: int = 0  # in the group (DDP over its ranks when it has several)
    group_size: int = 1
    port: int = 0  # the group's own store, when it has several ranks


class SampleLog(Callback):
    """Appends the sample ids of each committed step to `samples_<group>_<pid>.jsonl`;
    kills the process, or slows it until the killed peer is back, on cue."""

    def __init__(self, plan: GroupPlan, unit: Regression) -> None:
        self.plan, self.unit = plan, unit
        self.path = plan.out / f"samples_{plan.replica_id}_{os.getpid()}.jsonl"

    def on_step_start(self, trainer: Trainer, batches: Any) -> None:
        if trainer.step_nr == self.plan.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.replicas.committed:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": trainer.step_nr, "ids": self.unit.ids}) + "\n")
        rejoined = self.plan.out / "rejoined"
        if self.plan.restarted:
            rejoined.touch()
        elif self.plan.slow_until_rejoined and not rejoined.exists():
            time.sleep(0.05)  # the healthy groups go on, slowly enough to be rejoined
            if self.plan.hold_at is not None and trainer.step_nr >= self.plan.hold_at:
                _wait_for(self.plan.out / "restart_heartbeats", time.monotonic() + 60)


def run_group(plan: GroupPlan) -> None:
    """One rank of a replica group: the Trainer with a `ReplicaGroup` (DDP inside the group
    when it has several ranks)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from gangs import setup_gangs, setup_root_gang
    from gangtrain.parallel import data_parallel
    from trainer.fault_tolerance import FaultToleranceSettings, ReplicaGroup

    if plan.group_size > 1:  # the group's own job, as torchrun would start it
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port),
                          RANK=str(plan.rank), LOCAL_RANK=str(plan.rank),
                          WORLD_SIZE=str(plan.group_size),
                          LOCAL_WORLD_SIZE=str(plan.group_size))
        dist.init_process_group("gloo", rank=plan.rank, world_size=plan.group_size)
    gangs = setup_gangs(setup_root_gang())
    settings = FaultToleranceSettings(replica_groups=3, replica_id=plan.replica_id,
                                      lighthouse=plan.lighthouse, timeout_s=10)
    group = ReplicaGroup(settings, gangs)
    (plan.out / f"started_{plan.replica_id}_{os.getpid()}").touch()
    if plan.restarted:
        (plan.out / "restart_heartbeats").touch()
    while len(list(plan.out.glob("started_*"))) < plan.wait_for:  # all heartbeat first:
        time.sleep(0.05)  # the first quorum then holds every group
    model = make_model()
    if gangs.dp.size > 1:
        model = data_parallel(model, gangs, "ddp")
    unit = Regression(model)
    trainer = Trainer(unit, Rows(gangs.dp.rank, gangs.dp.size), make_optimizer(model),
                      gangs=gangs, output_dir=plan.out / f"group_{plan.replica_id}_{os.getpid()}",
                      max_num_steps=plan.steps, replica_group=group,
                      callbacks=[SampleLog(plan, unit)], recorders=[], progress=False,
                      num_threads=1)
    trainer.run()
    plain = getattr(model, "module", model)
    torch.save({"params": dict(plain.state_dict()), "healed": group.healed,
                "uncommitted": group.uncommitted_steps, "step": trainer.step_nr},
               plan.out / f"final_{plan.replica_id}_{plan.rank}.pt")
    group.close()


def _group_process(plan: GroupPlan) -> None:
    code = 0
    try:
        run_group(plan)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    os._exit(code)  # torchft's threads and pytest's atexit handlers: none at exit


def _lighthouse_process(conn: Any, min_replicas: int) -> None:
    from torchft.coordination import LighthouseServer
    # A dead group is dropped after 2 s without a heartbeat; a quorum waits up to 3 s for a
    # live (heartbeating) group that has not asked yet: a group slowed by a loaded machine
    # is waited for, not left out.
    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=3000,
                              heartbeat_timeout_ms=2000)
    conn.send(server.address())
    time.sleep(3600)


@dataclass
class RunResult:
    finals: dict[int, dict[str, Any]]  # by group: params, healed, uncommitted, step
    committed: dict[int, list[list[int]]]  # by step: each group's sample ids
    healthy_exit_codes: list[int | None]
    seconds: float


def run(out: Path, steps: int, kill_at: int | None = None, timeout: float = 120,
        group_size: int = 1) -> RunResult:
    """Three replica groups of `group_size` processes (forked from this one) over a
    lighthouse; group 2 (all its ranks) killed at the start of step `kill_at` and restarted
    once the others have trained 2 steps without it, when given."""
    ctx = mp.get_context("fork")
    start = time.monotonic()
    parent, child = ctx.Pipe()
    lighthouse = ctx.Process(target=_lighthouse_process, args=(child, 2), daemon=True)
    lighthouse.start()
    address = parent.recv()

    def start_group(plan: GroupPlan) -> list[Any]:
        port = free_port()
        ranks = [ctx.Process(target=_group_process, args=(replace(
            plan, rank=rank, group_size=group_size, port=port),)) for rank in range(group_size)]
        for p in ranks:
            p.start()
        return ranks

    groups = []
    try:
        for i in range(3):
            groups.append(start_group(GroupPlan(
                out, i, address, steps, wait_for=3 * group_size,
                kill_at=kill_at if i == 2 else None,
                slow_until_rejoined=kill_at is not None and i != 2,
                hold_at=None if kill_at is None else kill_at + 3)))
        if kill_at is not None:
            for p in groups[2]:
                p.join(timeout)
                assert p.exitcode == -signal.SIGKILL, p.exitcode
            _wait_for_step(out, kill_at + 2, start + timeout)  # trained on without it
            groups[2] = start_group(GroupPlan(out, 2, address, steps, restarted=True))
        for p in (p for ranks in groups for p in ranks):
            p.join(max(1.0, timeout - (time.monotonic() - start)))
        codes = [[p.exitcode for p in ranks] for ranks in groups]
        assert codes == [[0] * group_size] * 3, f"replica groups' exit codes: {codes}"
    finally:
        for p in [*(p for ranks in groups for p in ranks), lighthouse]:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
    seconds = time.monotonic() - start
    finals = {i: torch.load(out / f"final_{i}_0.pt", weights_only=True) for i in range(3)}
    committed: dict[int, list[list[int]]] = {}
    for path in sorted(out.glob("samples_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            committed.setdefault(record["step"], []).append(record["ids"])
    return RunResult(finals, committed, codes[0] + codes[1], seconds)


def _wait_for(path: Path, deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_step(out: Path, step_nr: int, deadline: float) -> None:
    """Until group 0 has committed `step_nr`."""
    while time.monotonic() < deadline:
        for path in out.glob("samples_0_*.jsonl"):
            lines = path.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step_nr:
                return
        time.sleep(0.02)
    raise TimeoutError(f"group 0 did not reach step {step_nr}")


def global_batch(step_nr: int) -> list[int]:
    """The sample ids of step `step_nr`'s global batch, by `GlobalBatchReader`'s rule (a
    randperm seeded SEED + epoch, cut into global batches)."""
    per_epoch = NUM_SAMPLES // GLOBAL_BATCH
    epoch, index = divmod(step_nr - 1, per_epoch)
    order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
    return order[index * GLOBAL_BATCH:(index + 1) * GLOBAL_BATCH].tolist()


class StepRecord(Callback):
    """Today's job: appends each step it trains to `steps_<rank>.jsonl`; rank 2 SIGKILLs
    itself at the start of step `kill_at`."""

    def __init__(self, out: Path, rank: int, kill_at: int | None) -> None:
        self.path, self.rank, self.kill_at = out / f"steps_{rank}.jsonl", rank, kill_at

    def on_step_start(self, trainer: Trainer, batches: Any) -> None:
        if self.rank == 2 and trainer.step_nr == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Trainer) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.step_nr}) + "\n")


def _ddp_rank(out: Path, rank: int, port: int, steps: int, every: int,
              kill_at: int | None) -> None:
    import torch.distributed as dist

    from gangs import setup_gangs, setup_root_gang
    from gangtrain.parallel import data_parallel

    code = 0
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
        dist.init_process_group("gloo", rank=rank, world_size=3)
        gangs = setup_gangs(setup_root_gang())
        model = data_parallel(make_model(), gangs, "ddp")
        Trainer(Regression(model), Rows(rank, 3), make_optimizer(model), gangs=gangs,
                output_dir=out / "job", max_num_steps=steps, checkpoint_every_n_steps=every,
                callbacks=[StepRecord(out, rank, kill_at)], recorders=[], progress=False,
                num_threads=1).run()
    except BaseException:
        code = 1
    os._exit(code)


def restart_run(out: Path, steps: int, kill_at: int, every: int,
                timeout: float = 120) -> tuple[int, float]:
    """Today: one DDP job over 3 ranks, checkpoints every `every` steps; rank 2 killed at
    step `kill_at`; every rank then stopped (as torchrun's agent does) and the job started
    again, resuming from its newest checkpoint. The steps trained twice and the wall time."""
    ctx = mp.get_context("fork")
    start = time.monotonic()
    for kill in (kill_at, None):  # the failed job, then its restart
        port = free_port()
        ranks = [ctx.Process(target=_ddp_rank, args=(out, r, port, steps, every, kill))
                 for r in range(3)]
        for p in ranks:
            p.start()
        if kill is not None:
            ranks[2].join(timeout)
        for p in ranks:
            if kill is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # the agent stops the job's other workers
            p.join(timeout)
    trained = [json.loads(line)["step"] for line in (out / "steps_0.jsonl").read_text()
               .splitlines()]
    assert trained[-1] == steps, trained
    return len(trained) - steps, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=9)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval today")
    parser.add_argument("--group-size", type=int, default=1, help="ranks a group (DDP)")
    parser.add_argument("--recipe", choices=["sft"], default=None,
                        help="the groups run this recipe's command instead")
    args = parser.parse_args()
    if args.recipe is not None:
        recipe_main(args.steps if args.steps != 24 else 16,
                    args.kill_at if args.kill_at != 9 else 6)
        return
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        clean = run(Path(a), args.steps, group_size=args.group_size)
        failed = run(Path(b), args.steps, kill_at=args.kill_at, group_size=args.group_size)
    lost = [failed.finals[i]["uncommitted"] for i in (0, 1)]
    same = all(torch.equal(failed.finals[0]["params"][k], failed.finals[i]["params"][k])
               for i in (1, 2) for k in failed.finals[0]["params"])
    samples_ok = all(sorted(sum(failed.committed.get(s, []), [])) == sorted(global_batch(s))
                     for s in range(1, args.steps + 1))
    with tempfile.TemporaryDirectory() as c, tempfile.TemporaryDirectory() as d:
        restart_lost, restart_seconds = restart_run(Path(c), args.steps, args.kill_at,
                                                    args.every)
        _, plain_seconds = restart_run(Path(d), args.steps, args.steps + 1, args.every)
    print(f"fault_tolerance: 3 replica groups x {args.group_size} process(es), {args.steps} "
          "steps, group 2 "
          f"SIGKILLed at step {args.kill_at} and restarted")
    print(f"  torchft: steps done again on the healthy groups: {lost} (target 0-1); healthy "
          f"processes' exit codes {failed.healthy_exit_codes} (none restarted); the "
          f"restarted group recovered live {failed.finals[2]['healed']} time(s); same "
          f"weights on every group: {same}; every committed step's samples = its global "
          f"batch, once: {samples_ok}")
    print(f"  wall time: {failed.seconds:.1f} s with the failure, {clean.seconds:.1f} s "
          f"without (ratio {failed.seconds / clean.seconds:.2f}; the healthy groups wait "
          "50 ms a step until the restarted one is back, so that it rejoins before the end)")
    print(f"  today, one DDP job over 3 processes, checkpoints every {args.every} steps, the "
          f"same failure, every process restarted from the last checkpoint: {restart_lost} "
          f"step(s) done again on every rank; wall time {restart_seconds:.1f} s against "
          f"{plain_seconds:.1f} s without the failure (ratio "
          f"{restart_seconds / plain_seconds:.2f}; processes forked, so the restart costs no "
          "imports: a real one adds torchrun's and the imports' start)")


def recipe_main(steps: int, kill_at: int) -> None:
    """`--recipe sft` (see the module docstring)."""
    from safetensors.torch import load_file

    from benchmarks.ft_recipe import make_tiny_sft, run_groups, steps_done_again

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        tiny = make_tiny_sft(base)
        clean_s = run_groups(base / "clean", *tiny, steps)
        print(f"fault_tolerance --recipe sft: 3 groups x 1 process, {steps} steps; "
              f"without a failure {clean_s:.1f} s")
        for victim in (0, 1):
            out = base / f"kill{victim}"
            seconds = run_groups(out, *tiny, steps, kill=victim, kill_at=kill_at,
                                 hold_at=kill_at + 3)
            final = [load_file(out / f"g{i}" / "hf" / "model.safetensors") for i in range(3)]
            same = all(f[k].equal(final[0][k]) for f in final for k in final[0])
            again = {i: steps_done_again(out, i) for i in range(3) if i != victim}
            print(f"  group {victim} SIGKILLed at step {kill_at}, restarted: steps done again "
                  f"on the healthy groups {again}; every process exited 0; same weights on "
                  f"every group: {same}; wall {seconds:.1f} s (ratio {seconds / clean_s:.2f}; "
                  "the healthy groups wait at step "
                  f"{kill_at + 3} for the restart, which re-imports and reloads)")


if __name__ == "__main__":
    main()
