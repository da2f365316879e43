"""`gangs.fault_tolerance` refuses what cannot work before anything starts, naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.config.sections import GangsSection


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
