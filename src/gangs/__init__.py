"""Process gangs: the root, data-, tensor- and expert-parallel groups of a job, all read off
one table of named mesh axes (`gangs.setup.mesh_views`), and the decisions every rank shares.
Imports torch only: model layers live in `layers`, wrappers and the build plan in `parallel`."""

from gangs.decisions import (
    any_rank,
    any_rank_each,
    describe,
    first_error,
    on_rank0,
    rank0_first,
)
from gangs.fake import FakeGang
from gangs.gang import Gang, GangError, ReduceOperation
from gangs.process_group import ProcessGroupGang, default_device, host_gang, setup_root_gang
from gangs.setup import Gangs, check_sizes, setup_gangs

__all__ = [
    "FakeGang",
    "Gang",
    "GangError",
    "Gangs",
    "ProcessGroupGang",
    "ReduceOperation",
    "any_rank",
    "any_rank_each",
    "check_sizes",
    "default_device",
    "describe",
    "first_error",
    "host_gang",
    "on_rank0",
    "rank0_first",
    "setup_gangs",
    "setup_root_gang",
]
