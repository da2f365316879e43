"""`ReplicaGroup`: this job's seat among torchft replica groups that train one model.

The groups are the DP-replicate axis, made fault tolerant: each group is a job of its own
(its gangs, DDP/FSDP2/TP inside, as without this), and the groups meet over torchft's
`Manager` and its reconfigurable Gloo process group. A step goes:

1. `start_step`: a quorum of the live groups (a group that died is left out; one that is
   behind, a restarted one, first receives the model, the optimizer and every stateful
   component of the Trainer from a healthy peer, live: one that finished, see `close`);
   this group's share of the global batch follows the groups in the quorum
   (`GlobalBatchReader.set_share`): its rank among them by replica_id. At a run's first
   step the groups wait for each other (`_meet_every_group`), so a run without a failure
   is trained by every group from its first step, whichever group started first;
2. `step`: the gradients and the target count summed over the groups of the quorum (the
   gradient of the mean loss over every target the groups that took part drew, not over a
   fixed world size); the optimizer steps only if every group's reduction held;
3. a step that did not commit is undone at the next `start_step`: every stateful component
   (step number, data position, random streams, metrics) is put back, so its global batch
   is drawn again, shared among the groups then alive: none trained twice, none skipped.

torchft is imported only here, and only when the setting is given.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from gangs import Gangs
from gangs.fault_tolerance import FaultToleranceSettings, LocalLighthouse
from trainer.errors import UserError
from trainer.step.optimizer_step import OptimizerStep, StepOutcome

log = logging.getLogger("gangtrain")

__all__ = ["replica_group_of", "ReplicaGroup"]


def import_torchft() -> Any:
    try:
        import torchft
    except ImportError:
        raise UserError("gangs.fault_tolerance needs torchft, which is not installed: "
                        "pip install 'gangtrain[ft]' (or remove gangs.fault_tolerance)") from None
    return torchft


class ReplicaGroup:
    def __init__(self, settings: FaultToleranceSettings, gangs: Gangs, *,
                 lighthouse: Any = None) -> None:
        """Join the lighthouse as replica group `settings.replica_id`; `gangs` are this
        group's own (one job: torchrun's world, or one process). `lighthouse`: the local
        lighthouse's marks of this group (`LocalLighthouse`; `close` marks it finished)."""
        torchft = import_torchft()
        if settings.lighthouse is None:
            raise UserError("gangs.fault_tolerance.lighthouse: no address given (the recipe "
                            "starts a lighthouse for a local run; a Trainer needs the address)")
        self.settings, self.gangs, self.lighthouse = settings, gangs, lighthouse
        timeout = timedelta(seconds=settings.timeout_s)
        # The group's own store: torchrun's under torchrun, else one in this process.
        store_addr, store_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if store_addr is None or store_port is None:
            from torch.distributed import TCPStore
            self._own_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._own_store.port
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=None, state_dict=None,  # registered by `attach`
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,  # heal before the forward: the step starts in sync
            timeout=timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            rank=gangs.root.rank, world_size=gangs.root.size,
            store_addr=store_addr, store_port=int(store_port),
            lighthouse_addr=settings.lighthouse,
            replica_id=f"replica_group_{settings.replica_id}",
        )
        self._states: Callable[[], dict[str, Any]] | None = None
        self._reader: Any = None
        self._before_step: dict[str, Any] | None = None  # the components before this step
        self._started = False  # the first quorum of this process is behind
        self._stepped = False  # a step since the last quorum (the run did not end at one)
        self.committed = True  # whether the last step committed
        self.uncommitted_steps = 0  # steps undone in this process (a failure's cost)
        self.healed = 0  # live recoveries of this process from a peer

    # -- wiring (once, by the Trainer) --------------------------------------------------------
    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               states: Callable[[], dict[str, Any]], reader: Any) -> None:
        """What a joining group receives from a healthy peer: the model, the optimizer and
        every stateful component (`states()`: the Trainer's `{name: Stateful}`)."""
        if not callable(getattr(reader, "set_share", None)):
            raise UserError(
                f"gangs.fault_tolerance: the data reader ({type(reader).__name__}) cannot "
                "take a share of the global batch that follows the live replica groups; use "
                "a data.global_batches.GlobalBatchReader (position counted in global batches)")
        min_batch = self.settings.replica_groups * self.gangs.dp.size
        if reader.batch_size < min_batch:
            raise UserError(f"gangs.fault_tolerance: the global batch ({reader.batch_size}) "
                            f"is smaller than replica_groups x dp size ({min_batch}): some "
                            "rank would draw no sample")
        self._states, self._reader = states, reader

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "components": {name: c.state_dict() for name, c in states().items()},
                    "replica_id": self.settings.replica_id}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            self._load_components(state["components"])
            self._before_step = None  # the peer's state is the committed one
            self.healed += 1
            log.warning("replica group %d recovered live from replica group %d at step %d",
                        self.settings.replica_id, state["replica_id"], self.manager.current_step())

        self.manager.register_state_dict_fn("trainer", load_state_dict, state_dict)

    # -- a step -------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Undo an uncommitted step, meet the live groups (receiving their state when this
        group is behind), and take this step's share of the global batch."""
        if self._before_step is not None and not self.committed:
            self._load_components(self._before_step)
        self.manager.start_quorum()
        self._stepped = False
        if not self._started:
            self._started = True
            self._meet_every_group(starting=True)
        rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:  # not in this quorum: nothing to share out (torchft zeroes its part)
            rank, participants = 0, max(participants, 1)
        dp = self.gangs.dp
        self._reader.set_share(rank * dp.size + dp.rank, participants * dp.size)
        assert self._states is not None, "attach() first"
        self._before_step = {name: copy.deepcopy(c.state_dict())
                             for name, c in self._states().items()}

    def _meet_every_group(self, starting: bool) -> None:
        """Quorums again, up to `quorum_timeout_s`, until one holds every group (or this one
        received a peer's state): at a run's start, so that every group trains its first
        step; at its end, serving this group's state to any still behind, until two in a row
        do (one that recovered in the first asked the second with its state) or all finished."""
        s, m, step = self.settings, self.manager, self.manager.current_step()
        deadline, wanted, full = time.monotonic() + s.quorum_timeout_s, s.replica_groups, starting
        while not (full and m.num_participants() == wanted) and m.current_step() == step:
            full = starting or m.num_participants() == wanted  # the last quorum held all
            stop = [time.monotonic() > deadline, [i for i in range(wanted) if i != s.replica_id
                    and self.lighthouse and (self.lighthouse.FOLDER / f"done_{i}").exists()]]
            self.gangs.root.broadcast_objects(stop)  # the group's first rank decides
            if stop[0] and starting and stop[1]:  # never retrain alone what others finished
                raise UserError(f"replica group {s.replica_id} has no peer at step 0 and groups "
                                f"{stop[1]} finished the run: nothing to recover from")
            if not starting and len(stop[1]) == wanted - 1:
                return  # every other group finished: none left to serve
            if stop[0]:
                log.warning("replica group %d %s with %d of %d groups (no other came in %.0f "
                            "s)", s.replica_id, "starts" if starting else "stops serving",
                            m.num_participants(), wanted, s.quorum_timeout_s)
                return
            time.sleep(0.05)
            m.start_quorum()

    def step(self, optimizer_step: OptimizerStep, loss: Tensor, count: Tensor | int,
             normalised: bool, step_nr: int, measure_norm: bool) -> StepOutcome:
        """`optimizer_step` on the gradients summed over the groups of the quorum, if the
        quorum held; else nothing is stepped and the step is undone at the next start."""
        self._stepped = True
        count = self._sum_over_groups(optimizer_step.params, count, normalised)
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.uncommitted_steps += 1
            log.warning("step %d did not commit (a replica group failed): drawn again", step_nr)
            return StepOutcome(skipped=True)
        # A group that had no target still steps: its optimizer stays with its peers'.
        return optimizer_step(loss, count, False, step_nr, measure_norm)

    def _sum_over_groups(self, params: list[Tensor], count: Tensor | int,
                         normalised: bool) -> Tensor:
        """The gradient sums and the target count, summed over the groups of the quorum in
        one float64 all-reduce (the count exact; each gradient rounded once, on the way
        back); the count as a 0-dim tensor. DDP/FSDP2 left the gradients averaged over the
        group's dp ranks: the optimizer step's `dp_size / count` scale still fits."""
        # Every group lays out the same buffer: a parameter without a gradient here (unused
        # by this group's share) takes zeros, which its peers' gradients are added to.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        count_t = torch.as_tensor(count, dtype=torch.float64).reshape(1).cpu()
        # Backward started from 1 / count (one process, a host count): back to sums.
        scale = float(count_t) if normalised else 1.0
        flat = torch.cat([g.detach().reshape(-1).cpu().double() * scale for g in local]
                         + [count_t])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        for g, summed in zip(local, flat[:-1].split([g.numel() for g in local])):
            g.copy_(summed.view_as(g))
        return flat[-1].to(params[0].device if params else "cpu")

    @property
    def live_groups(self) -> LiveGroups:
        """The groups of this step's quorum, as a gang for the small sums a forward needs
        (the MoE router statistics of the global micro-batch)."""
        return LiveGroups(self.manager)

    def _load_components(self, states: dict[str, Any]) -> None:
        assert self._states is not None
        for name, component in self._states().items():
            if name in states:
                component.load_state_dict(states[name])

    def close(self, finished: bool = True) -> None:
        """Leave the groups. `finished`: this group's training ended (the local lighthouse
        ends once every group has); a group that failed says nothing, so the lighthouse
        waits for its restart."""
        if finished and not self._stepped:  # the run's end, not a stop after a step (signal)
            if self.manager.num_participants() < self.settings.replica_groups:
                log.info("replica group %d finished: it serves its state to the groups behind",
                         self.settings.replica_id)
            self._meet_every_group(starting=False)
            # Rank 0 hosts the group's manager: none shuts it down while another rank of the
            # group still waits for that last quorum's answer from it.
            self.gangs.root.barrier()
        self.manager.shutdown(wait=False)
        if finished and self.lighthouse is not None:
            self.lighthouse.finished()


class LiveGroups:
    """The live replica groups as a gang that sums (`all_reduce(tensor, SUM)`, in place):
    the same rank of every group of this step's quorum, in float64 on the host (rounded
    once, on the way back). A failure shows at the step's commit, as for the gradients."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    @property
    def size(self) -> int:
        return max(1, self.manager.num_participants())

    def all_reduce(self, tensor: Tensor, op: Any) -> None:
        if getattr(op, "name", op) not in ("SUM", "sum"):
            raise ValueError(f"the live replica groups only sum, not {op}")
        host = tensor.detach().to("cpu", torch.float64)
        self.manager.allreduce(host, reduce_op=ReduceOp.SUM).wait()
        tensor.copy_(host)


def replica_group_of(settings: FaultToleranceSettings | None,
                     gangs: Gangs) -> ReplicaGroup | None:
    """This job's `ReplicaGroup` (None without the setting); `close()` it at the end."""
    if settings is None:
        return None
    import_torchft()  # the clear message first, when it is missing
    lighthouse = None
    if settings.lighthouse is None:
        lighthouse = LocalLighthouse(settings, owner=gangs.root.rank == 0)
        settings = settings.model_copy(update={"lighthouse": lighthouse.address})
    return ReplicaGroup(settings, gangs, lighthouse=lighthouse)
