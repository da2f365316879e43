"""`Gangs` and `setup_gangs`: every process group and the `DeviceMesh`, built in one place.

Layout of a world of `dp * tp` ranks (TP ranks contiguous, like torchtitan):

    mesh[dp, tp]:  rank = d * tp_size + t

so the TP gang of rank r is {tp*(r//tp) ... tp*(r//tp)+tp-1} and its DP gang is
{r % tp + k * tp}. Expert parallelism is carved out of DP: the dp ranks are cut into
contiguous blocks of `ep_size`,

    dp index d  ->  ep group d // ep_size,  ep rank d % ep_size

and `expert_dp` joins the ranks holding the same experts (same `d % ep_size`): it is the
gang that reduces expert gradients, while every other gradient is reduced over `dp`.
With tp=1, dp=4, ep=2: ep gangs {0,1},{2,3}; expert_dp gangs {0,2},{1,3}.

HSDP (`dp_shard_size=K`, K < dp): FSDP2 shards over contiguous groups of K DP ranks (one
node, when a node holds K * tp ranks) and replicates across the groups. The mesh then has
three dimensions,

    mesh[dp_replicate, dp_shard, tp]:  d = i * K + j   (i: replica group, j: shard rank)

With tp=1, dp=4, K=2: dp_shard gangs {0,1},{2,3}; dp_replicate gangs {0,2},{1,3}. The dp
gang still joins all dp ranks (the trainer counts targets and syncs metrics over it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from gangs.fake import FakeGang
from gangs.gang import Gang
from gangs.process_group import ProcessGroupGang


@dataclass(frozen=True)
class Gangs:
    root: Gang
    dp: Gang
    tp: Gang
    ep: Gang
    expert_dp: Gang
    mesh: DeviceMesh | None = None
    """The mesh parameters are distributed over: `[dp, tp]` (names "dp", "tp"), or under
    HSDP `[dp_replicate, dp_shard, tp]`; None in one process."""
    ep_mesh: DeviceMesh | None = None
    """The `[expert_dp, ep, tp]` mesh when ep_size > 1."""
    dp_shard: Gang | None = None
    """HSDP: the DP ranks FSDP2 shards over; None when it shards over all of `dp`."""
    dp_replicate: Gang | None = None
    """HSDP: the DP ranks that hold the same shards; None without HSDP."""

    @property
    def device(self) -> torch.device:
        return self.root.device

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: `mesh["dp"]`, or the 2-D
        `mesh["dp_replicate", "dp_shard"]` under HSDP; None in one process."""
        if self.mesh is None:
            return None
        if self.dp_shard is not None:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp"]

    def close(self) -> None:
        self.root.close()


def check_sizes(
    world_size: int, tp_size: int = 1, ep_size: int = 1, dp_shard_size: int | None = None
) -> int:
    """The DP size of the layout; a `ValueError` naming the sizes when they do not fit."""
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"tp_size ({tp_size}) and ep_size ({ep_size}) must be >= 1")
    if world_size % tp_size != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tp_size {tp_size}"
        )
    dp_size = world_size // tp_size
    if dp_size % ep_size != 0:
        raise ValueError(
            f"ep_size {ep_size} must divide the data-parallel size {dp_size} "
            f"(world size {world_size} / tp_size {tp_size})"
        )
    if dp_shard_size is not None and (dp_shard_size < 1 or dp_size % dp_shard_size != 0):
        raise ValueError(
            f"dp_shard_size {dp_shard_size} must be >= 1 and divide the data-parallel size "
            f"{dp_size} (world size {world_size} / tp_size {tp_size})"
        )
    return dp_size


def setup_gangs(
    root: Gang, tp_size: int = 1, ep_size: int = 1, dp_shard_size: int | None = None
) -> Gangs:
    """Build every gang of a `root.size`-rank job (see the module docstring for the layout).

    `dp_shard_size` (HSDP): FSDP2 shards over groups of that many DP ranks and replicates
    across the groups; None (or the whole DP size) shards over every DP rank.
    """
    dp_size = check_sizes(root.size, tp_size, ep_size, dp_shard_size)
    hsdp = dp_shard_size is not None and dp_shard_size < dp_size
    if isinstance(root, FakeGang):
        return _fake_gangs(root, dp_size, tp_size, ep_size, dp_shard_size if hsdp else None)

    device_type = root.device.type
    world = torch.arange(root.size)
    # The flat [dp, tp] mesh gives the dp gang; under HSDP the parameters live on the 3-D
    # mesh (FSDP2 and TP must share one root mesh), whose "tp" gang is the same ranks.
    flat = DeviceMesh(device_type, world.view(dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp = ProcessGroupGang(flat.get_group("dp"), root.device)
    tp = ProcessGroupGang(flat.get_group("tp"), root.device)
    mesh, dp_shard, dp_replicate = flat, None, None
    if hsdp:
        assert dp_shard_size is not None
        mesh = DeviceMesh(
            device_type,
            world.view(dp_size // dp_shard_size, dp_shard_size, tp_size),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        tp = ProcessGroupGang(mesh.get_group("tp"), root.device)
        dp_shard = ProcessGroupGang(mesh.get_group("dp_shard"), root.device)
        dp_replicate = ProcessGroupGang(mesh.get_group("dp_replicate"), root.device)
    hsdp_gangs = {"dp_shard": dp_shard, "dp_replicate": dp_replicate}
    if ep_size == 1:
        return Gangs(root, dp, tp, ep=FakeGang(device=root.device), expert_dp=dp, mesh=mesh,
                     **hsdp_gangs)

    ep_mesh = DeviceMesh(
        device_type,
        world.view(dp_size // ep_size, ep_size, tp_size),
        mesh_dim_names=("expert_dp", "ep", "tp"),
    )
    ep = ProcessGroupGang(ep_mesh.get_group("ep"), root.device)
    expert_dp = ProcessGroupGang(ep_mesh.get_group("expert_dp"), root.device)
    return Gangs(root, dp, tp, ep, expert_dp, mesh=mesh, ep_mesh=ep_mesh, **hsdp_gangs)


def _fake_gangs(
    root: FakeGang, dp_size: int, tp_size: int, ep_size: int, dp_shard_size: int | None
) -> Gangs:
    r, dev = root.rank, root.device
    d, t = divmod(r, tp_size)
    hsdp = {}
    if dp_shard_size is not None:
        i, j = divmod(d, dp_shard_size)
        hsdp = {"dp_shard": FakeGang(j, dp_shard_size, dev),
                "dp_replicate": FakeGang(i, dp_size // dp_shard_size, dev)}
    return Gangs(
        root=root,
        dp=FakeGang(d, dp_size, dev),
        tp=FakeGang(t, tp_size, dev),
        ep=FakeGang(d % ep_size, ep_size, dev),
        expert_dp=FakeGang(d // ep_size, dp_size // ep_size, dev),
        **hsdp,
    )
