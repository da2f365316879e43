"""A checkpoint round trip on the running interpreter, and what the safe DCP unpickler
accepts. `.ci/python_versions` runs this file under every Python the project claims
(Debian 12's `python3`, 3.11.2, among them): there DCP pickles enum members as
`builtins.getattr(EnumClass, "NAME")`, which must load, while a `getattr` on anything else
stays refused."""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import subprocess
import sys
from enum import Enum
from pathlib import PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny import GlobalRows, make_model
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer import Trainer
from trainer.checkpoint import read_model_state
from trainer.checkpoint.manifest import read_dcp_metadata
from trainer.errors import UserError
from units.regression import SquaredErrorUnit


def train(out, max_num_steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    Trainer(SquaredErrorUnit(model), GlobalRows(), torch.optim.AdamW(model.parameters()),
            output_dir=out, max_num_steps=max_num_steps, checkpoint_every_n_steps=3,
            recorders=[], progress=False).run()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_checkpoint_round_trip_on_this_interpreter(tmp_path, caplog):
    straight = train(tmp_path / "straight", 6)
    train(tmp_path / "resumed", 3)
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        resumed = train(tmp_path / "resumed", 6)  # loads step_3: DCP metadata, rank state
    step_3 = tmp_path / "resumed" / "checkpoints" / "step_3"
    assert f"resumed from {step_3} (step 3)" in caplog.text  # not a fresh start
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), f"{name} on Python {sys.version}"
    exported = read_model_state(tmp_path / "resumed" / "checkpoints" / "step_6")
    for name, value in straight.items():
        assert torch.equal(exported[name], value), name


class _AsGetattr(pickle.Pickler):
    """Pickles enum members (and `Fake` objects) as `getattr(owner, name)`, the way
    Python 3.11.0-3.11.3 pickle enum members, whatever Python runs the test."""

    def reducer_override(self, obj):
        if isinstance(obj, Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, Fake):
            return getattr, (obj.owner, obj.name)
        return NotImplemented


@dataclasses.dataclass
class Fake:
    owner: object
    name: str


def metadata_file(tmp_path, payload=None):
    """A real DCP `.metadata` of a small model, re-pickled as 3.11.2 does (plus `payload`
    in its planner data, when given)."""
    model = make_model()
    model_state, optim_state = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    dcp.save({"model": model_state}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    metadata = read_dcp_metadata(tmp_path / "dcp" / ".metadata")
    if payload is not None:
        metadata.planner_data = {"x": payload}
    buffer = io.BytesIO()
    _AsGetattr(buffer).dump(metadata)
    path = tmp_path / "as_3_11_2.metadata"
    path.write_bytes(buffer.getvalue())
    return path, buffer.getvalue()


def test_dcp_enum_pickled_through_getattr_is_accepted(tmp_path):
    path, raw = metadata_file(tmp_path)
    assert b"getattr" in raw and b"_MEM_FORMAT_ENCODING" in raw  # as 3.11.2 writes it
    metadata = read_dcp_metadata(path)
    properties = next(iter(metadata.state_dict_metadata.values())).properties
    assert properties.memory_format == torch.contiguous_format


@pytest.mark.parametrize("owner, name", [
    (PosixPath, "home"),                                     # an allowed class, not an enum
    (torch.Size, "__class__"),
    (dcp_metadata._MEM_FORMAT_ENCODING, "__class__"),        # a DCP enum, not a member
    (dcp_metadata._MEM_FORMAT_ENCODING, "_member_map_"),
])
def test_getattr_on_anything_else_is_refused(tmp_path, owner, name):
    path, _ = metadata_file(tmp_path, Fake(owner, name))
    with pytest.raises(UserError, match="not a member of a DCP enum"):
        read_dcp_metadata(path)


def test_getattr_on_a_class_that_is_not_allowed_is_refused(tmp_path):
    path, _ = metadata_file(tmp_path, Fake(subprocess.Popen, "wait"))  # not allowed at all
    with pytest.raises(UserError, match="refusing to read"):
        read_dcp_metadata(path)
