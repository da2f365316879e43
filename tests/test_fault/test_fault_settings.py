"""`gangs.fault_tolerance` refuses what cannot work before anything starts, naming the field."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from gangtrain.app.config.sections import GangsSection


@pytest.mark.parametrize(("setting", "message"), [
    ({"replica_groups": 3, "replica_id": 3}, "replica_id 3 is not below replica_groups 3"),
    ({"replica_groups": 2, "min_replicas": 3}, "min_replicas 3 exceeds replica_groups 2"),
    ({"replica_groups": 2, "replica": 1}, "replica"),  # a misspelt key
])
def test_fault_tolerance_settings_refuse_what_cannot_work(setting, message):
    with pytest.raises(ValidationError, match=message) as error:
        GangsSection(fault_tolerance=setting)
    assert "fault_tolerance" in str(error.value)


def test_without_fault_tolerance_nothing_of_torchft_is_set():
    assert GangsSection().fault_tolerance is None


def test_fault_tolerance_without_torchft_installed_says_how_to_install_it(monkeypatch):
    from gangs import FakeGang, setup_gangs
    from trainer.errors import UserError
    from trainer.fault_tolerance import FaultToleranceSettings, replica_group_of

    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    settings = FaultToleranceSettings(replica_groups=2)
    with pytest.raises(UserError, match=r"needs torchft.*pip install 'gangtrain\[ft\]'"):
        replica_group_of(settings, setup_gangs(FakeGang()))
    assert replica_group_of(None, setup_gangs(FakeGang())) is None  # off: nothing imported
