"""`Gangs` and `setup_gangs`: every process group and the `DeviceMesh`, built in one place
from one table of named axes (`mesh_views`).

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

Pipeline and context parallelism (`pp_size`, `cp_size`) add two axes to every view: `pp`
outermost (stages cross nodes: it moves the least data), `cp` between the DP axes and `tp`
(the sequence split's all-to-alls are heavier than DP's reductions, lighter than TP's):

    world [pp, dp, cp, tp]:  rank = ((p * dp + d) * cp + c) * tp + t

An axis of size 1 is left out of the meshes, so layouts without PP or CP keep the meshes
they had. The dp gang joins the ranks that differ in `d` only: every pp stage and every cp
slice reads the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    pp: Gang = field(default_factory=FakeGang)
    """The pipeline stages of one model replica (size 1 without pipeline parallelism)."""
    cp: Gang = field(default_factory=FakeGang)
    """The ranks that split each sequence (size 1 without context parallelism)."""

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
    world_size: int, tp_size: int = 1, ep_size: int = 1, dp_shard_size: int | None = None,
    pp_size: int = 1, cp_size: int = 1,
) -> int:
    """The DP size of the layout; a `ValueError` naming the sizes when they do not fit, or
    when they combine axes that do not work together yet."""
    for name, size in (("tp_size", tp_size), ("ep_size", ep_size), ("pp_size", pp_size),
                       ("cp_size", cp_size)):
        if size < 1:
            raise ValueError(f"{name} ({size}) must be >= 1")
    model_ranks = pp_size * cp_size * tp_size
    if world_size % model_ranks != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by pp_size {pp_size} x cp_size "
            f"{cp_size} x tp_size {tp_size} = {model_ranks}"
            if pp_size * cp_size > 1 else
            f"world size {world_size} is not divisible by tp_size {tp_size}"
        )
    dp_size = world_size // model_ranks
    where = (f"(world size {world_size} / tp_size {tp_size})" if pp_size * cp_size == 1 else
             f"(world size {world_size} / (pp_size {pp_size} x cp_size {cp_size} x tp_size "
             f"{tp_size}))")
    if dp_size % ep_size != 0:
        raise ValueError(
            f"ep_size {ep_size} must divide the data-parallel size {dp_size} {where}"
        )
    if dp_shard_size is not None and (dp_shard_size < 1 or dp_size % dp_shard_size != 0):
        raise ValueError(
            f"dp_shard_size {dp_shard_size} must be >= 1 and divide the data-parallel size "
            f"{dp_size} {where}"
        )
    _refuse_unsupported(pp_size, cp_size)
    return dp_size


def _refuse_unsupported(pp_size: int, cp_size: int) -> None:
    """The combination not built yet, refused by name: context parallelism inside pipeline
    stages (each runs with DP, HSDP, TP and EP; the recipes refuse it first, by setting)."""
    if pp_size > 1 and cp_size > 1:
        raise ValueError(
            f"pp_size {pp_size} with cp_size {cp_size} is not supported yet: context "
            "parallelism inside pipeline stages is not built; use one of them")


def mesh_views(
    dp_size: int, tp_size: int = 1, ep_size: int = 1, dp_shard_size: int | None = None,
    pp_size: int = 1, cp_size: int = 1,
) -> dict[str, dict[str, int]]:
    """The layout in one place: the world's rank grid `[pp, dp, cp, tp]` (TP innermost) and
    the named views of it that split the DP axis, each `{axis: size}`, outermost axis first.

    "world" `[pp, dp, cp, tp]`; "hsdp" `[dp_replicate, dp_shard, tp]` when FSDP2 shards over
    fewer than all DP ranks; "experts" `[expert_dp, ep, tp]` when experts are split (EP carved
    out of DP). `pp` and `cp` appear (in every view) only when larger than 1. Every gang is
    one axis of one view; a real job builds a `DeviceMesh` per view, one process reads its
    ranks off the same views.
    """
    def view(middle: dict[str, int]) -> dict[str, int]:
        axes = {"pp": pp_size} if pp_size > 1 else {}
        axes.update(middle)
        if cp_size > 1:
            axes["cp"] = cp_size
        axes["tp"] = tp_size
        return axes

    views = {"world": view({"dp": dp_size})}
    if dp_shard_size is not None and dp_shard_size < dp_size:
        views["hsdp"] = view({"dp_replicate": dp_size // dp_shard_size,
                              "dp_shard": dp_shard_size})
    if ep_size > 1:
        views["experts"] = view({"expert_dp": dp_size // ep_size, "ep": ep_size})
    return views


def setup_gangs(
    root: Gang, tp_size: int = 1, ep_size: int = 1, dp_shard_size: int | None = None,
    *, pp_size: int = 1, cp_size: int = 1,
) -> Gangs:
    """Build every gang of a `root.size`-rank job (see the module docstring for the layout).

    `dp_shard_size` (HSDP): FSDP2 shards over groups of that many DP ranks and replicates
    across the groups; None (or the whole DP size) shards over every DP rank. `pp_size`:
    pipeline stages; `cp_size`: ranks that split each sequence (with DP, HSDP, TP and EP).
    """
    dp_size = check_sizes(root.size, tp_size, ep_size, dp_shard_size, pp_size, cp_size)
    views = mesh_views(dp_size, tp_size, ep_size, dp_shard_size, pp_size, cp_size)
    if isinstance(root, FakeGang):
        return _fake_gangs(root, views)

    world = torch.arange(root.size)
    meshes = {view: DeviceMesh(root.device.type, world.view(*axes.values()),
                               mesh_dim_names=tuple(axes))
              for view, axes in views.items()}

    def gang(view: str, axis: str) -> ProcessGroupGang:
        return ProcessGroupGang(meshes[view].get_group(axis), root.device)

    # The parameters live on one root mesh (FSDP2 and TP must share it): the HSDP view when
    # there is one, whose "tp" gang is the same ranks as the world's.
    params = "hsdp" if "hsdp" in views else "world"
    hsdp = {"dp_shard": gang("hsdp", "dp_shard"),
            "dp_replicate": gang("hsdp", "dp_replicate")} if "hsdp" in views else {}
    dp = gang("world", "dp")
    experts = {"ep": gang("experts", "ep"), "expert_dp": gang("experts", "expert_dp"),
               "ep_mesh": meshes["experts"]} if "experts" in views else {
                   "ep": FakeGang(device=root.device), "expert_dp": dp}
    axes = {axis: gang("world", axis) if axis in views["world"] else FakeGang(device=root.device)
            for axis in ("pp", "cp")}
    return Gangs(root, dp, gang(params, "tp"), mesh=meshes[params], **experts, **hsdp,
                 **axes)


def _fake_gangs(root: FakeGang, views: dict[str, dict[str, int]]) -> Gangs:
    """One process of a larger layout (tests): its rank on each axis, read off the same
    views as a real job's meshes."""

    def gang(view: str, axis: str) -> FakeGang:
        axes = views[view]
        coordinates = torch.unravel_index(torch.tensor(root.rank), tuple(axes.values()))
        return FakeGang(int(coordinates[list(axes).index(axis)]), axes[axis], root.device)

    hsdp = {"dp_shard": gang("hsdp", "dp_shard"),
            "dp_replicate": gang("hsdp", "dp_replicate")} if "hsdp" in views else {}
    experts = "experts" if "experts" in views else None
    dp = gang("world", "dp")
    axes = {axis: gang("world", axis) if axis in views["world"] else FakeGang(0, 1, root.device)
            for axis in ("pp", "cp")}
    return Gangs(root=root, dp=dp, tp=gang("world", "tp"),
                 ep=gang(experts, "ep") if experts else FakeGang(0, 1, root.device),
                 expert_dp=gang(experts, "expert_dp") if experts else dp, **hsdp, **axes)
