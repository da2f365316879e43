"""YAML configs read as users mean them: `1e-3` is a number (PyYAML's YAML 1.1 read it as a
string), and a key written twice in one mapping is refused (PyYAML kept the last silently)."""

import pytest

from gangtrain.app.cli import load_config, run_recipe
from gangtrain.app.config.early_stopper import build_early_stopper
from trainer.errors import UserError


def test_exponent_numbers_are_numbers_in_files_and_overrides(config_type, presets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {root: /x}\n"
                    "trainer:\n  lr: 3e-4\n"
                    "  early_stopper: {name: patience, patience: 2, min_delta: 1e-3}\n")
    config = load_config(config_type, presets, config_files=[path])
    assert config.trainer.lr == 3e-4
    assert config.trainer.early_stopper.kwargs == {"patience": 2, "min_delta": 0.001}
    stopper = build_early_stopper(config.trainer.early_stopper, lower_better=True)
    # min_delta 1e-3 is a number the policy uses: 0.0005 better is no improvement.
    assert [stopper(step, score) for step, score in
            [(1, 1.0), (2, 0.9995), (3, 0.9991)]] == [False, False, True]
    config = load_config(config_type, presets, overrides=["data.root=/x",
                                                          "trainer.lr=5E-5"])
    assert config.trainer.lr == 5e-5


def test_a_key_twice_in_a_file_is_refused_naming_the_file_and_lines(
        config_type, presets, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("data: {root: /x}\ntrainer:\n  lr: 0.1\n  max_num_steps: 5\n  lr: 0.2\n")
    with pytest.raises(UserError) as raised:
        load_config(config_type, presets, config_files=[path])
    assert str(raised.value) == (
        f"config file '{path}' is not valid YAML: found the key 'lr' twice (first on line 3); "
        "a setting is given once per mapping (line 5, column 3)")
    code = run_recipe(config_type, presets, lambda *a: 0, argv=[str(tmp_path / "out"),
                      "--config-file", str(path)], prog="recipe")
    assert code == 2 and "found the key 'lr' twice" in capsys.readouterr().err


def test_a_key_twice_in_an_override_is_refused(config_type, presets):
    with pytest.raises(UserError, match="found the key 'patience' twice"):
        load_config(config_type, presets, overrides=[
            "data.root=/x", "trainer.early_stopper={name: patience, patience: 2, patience: 3}"])
