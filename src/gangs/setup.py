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
    """The `[dp, tp]` mesh (names "dp", "tp") for FSDP2 and DTensor; None in one process."""
    ep_mesh: DeviceMesh | None = None
    """The `[expert_dp, ep, tp]` mesh when ep_size > 1."""

    @property
    def device(self) -> torch.device:
        return self.root.device

    def close(self) -> None:
        self.root.close()


def check_sizes(world_size: int, tp_size: int = 1, ep_size: int = 1) -> int:
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
    return dp_size


def setup_gangs(root: Gang, tp_size: int = 1, ep_size: int = 1) -> Gangs:
    dp_size = check_sizes(root.size, tp_size, ep_size)
    if isinstance(root, FakeGang):
        return _fake_gangs(root, dp_size, tp_size, ep_size)

    device_type = root.device.type
    world = torch.arange(root.size)
    mesh = DeviceMesh(device_type, world.view(dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp = ProcessGroupGang(mesh.get_group("dp"), root.device)
    tp = ProcessGroupGang(mesh.get_group("tp"), root.device)
    if ep_size == 1:
        return Gangs(root, dp, tp, ep=FakeGang(device=root.device), expert_dp=dp, mesh=mesh)

    ep_mesh = DeviceMesh(
        device_type,
        world.view(dp_size // ep_size, ep_size, tp_size),
        mesh_dim_names=("expert_dp", "ep", "tp"),
    )
    ep = ProcessGroupGang(ep_mesh.get_group("ep"), root.device)
    expert_dp = ProcessGroupGang(ep_mesh.get_group("expert_dp"), root.device)
    return Gangs(root, dp, tp, ep, expert_dp, mesh=mesh, ep_mesh=ep_mesh)


def _fake_gangs(root: FakeGang, dp_size: int, tp_size: int, ep_size: int) -> Gangs:
    r, dev = root.rank, root.device
    d, t = divmod(r, tp_size)
    return Gangs(
        root=root,
        dp=FakeGang(d, dp_size, dev),
        tp=FakeGang(t, tp_size, dev),
        ep=FakeGang(d % ep_size, ep_size, dev),
        expert_dp=FakeGang(d // ep_size, dp_size // ep_size, dev),
    )
