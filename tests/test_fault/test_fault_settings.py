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


@pytest.mark.parametrize(("recipe", "setting", "named"), [
    ("lm", "gangs.pp_size=2", "gangs.pp_size"),
    ("lm", "gangs.cp_size=2", "gangs.cp_size"),
    ("lm", "gangs.ep_size=2", "gangs.ep_size"),
    ("sft", "data.max_tokens=512", "data.max_tokens"),
])
def test_every_recipe_refuses_by_name_what_a_replica_group_cannot_hold(recipe, setting, named,
                                                                       tmp_path, capsys):
    """Through the recipe's command line: exit 2, the setting named, nothing written."""
    from gangtrain.app.cli import run_recipe

    if recipe == "lm":
        from recipes.lm.config import PRESETS, LMConfig
        from recipes.lm.recipe import main
        cli = lambda argv: run_recipe(LMConfig, PRESETS, main, argv)  # noqa: E731
        extra = []
    else:
        from recipes.sft.recipe import cli
        extra = ["--set=model.path=unused", "--set=data.files=[unused.jsonl]",
                 "--set=data.packing=false"]
    out = tmp_path / "out"
    argv = [str(out), "--preset", "tiny", *extra, f"--set={setting}",
            "--set=gangs.fault_tolerance.replica_groups=2"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "gangs.fault_tolerance" in err, err
    assert not (out / "config.yaml").exists()  # nothing written (the run lock aside)
