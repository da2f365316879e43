"""run_recipe end to end: the command line, config.yaml, exit codes and error messages."""

import pytest
import yaml

from gangtrain.app.cli import load_config, run_recipe
from gangtrain.app.config.early_stopper import build_early_stopper
from trainer.early_stoppers import Patience
from trainer.errors import UserError


class Recorder:
    """A recipe main that records what it was given."""

    def __init__(self, code=0, raises=None):
        self.calls = []
        self.code, self.raises = code, raises

    def __call__(self, config, output_dir, resume):
        self.calls.append((config, output_dir, resume))
        if self.raises is not None:
            raise self.raises
        return self.code


@pytest.fixture
def run(config_type, presets):
    def run(*argv, main=None, default_preset=None):
        main = main if main is not None else Recorder()
        code = run_recipe(
            config_type,
            presets,
            main,
            argv=list(argv),
            prog="recipe",
            default_preset=default_preset,
        )
        return code, main

    return run


def test_runs_main_and_writes_config_yaml(run, tmp_path):
    out = tmp_path / "a" / "b"  # parents are created
    code, main = run(str(out), "--preset", "small", "--set", "trainer.max_num_steps=10")
    assert code == 0
    [(config, output_dir, resume)] = main.calls
    assert output_dir == out and resume is True
    assert config.trainer.max_num_steps == 10
    assert yaml.safe_load((out / "config.yaml").read_text()) == config.model_dump(mode="json")


def test_exit_code_and_no_resume(run, tmp_path):
    code, main = run(str(tmp_path), "--preset", "small", "--no-resume", main=Recorder(code=3))
    assert code == 3
    assert main.calls[0][2] is False


def test_default_preset(run, tmp_path):
    code, main = run(str(tmp_path), default_preset="small")
    assert code == 0
    assert main.calls[0][0].model.dim == 4
    code, main = run(
        str(tmp_path), "--preset", "big", "--set", "data.root=/x", default_preset="small"
    )
    assert main.calls[0][0].model.dim == 64


def test_dump_config_round_trip(run, config_type, presets, tmp_path, capsys):
    argv = ["--preset", "big", "--set", "data.root=/d"]
    argv += ["--set", "trainer.early_stopper={name: any_of, stoppers: [non_finite]}"]
    code, main = run("--dump-config", *argv)  # no OUTPUT_DIR needed
    assert code == 0 and main.calls == []
    dumped = capsys.readouterr().out
    dump_file = tmp_path / "dump.yaml"
    dump_file.write_text(dumped)

    original = load_config(config_type, presets, preset="big", overrides=argv[3::2])
    assert load_config(config_type, presets, config_files=[dump_file]) == original
    code, main = run(str(tmp_path / "out"), "--config-file", str(dump_file))
    assert code == 0
    assert main.calls[0][0] == original
    assert (tmp_path / "out" / "config.yaml").read_text() == dumped


def test_list_presets(run, capsys):
    code, _ = run("--list-presets", default_preset="big")
    assert code == 0
    assert capsys.readouterr().out.splitlines() == [
        "small  A small model for tests",
        "big    (default)",
    ]


def test_help_returns_zero(run, capsys):
    code, _ = run("--help")
    assert code == 0
    assert "--config-file" in capsys.readouterr().out


def test_early_stopper_set_as_flow_mapping(run, tmp_path):
    code, main = run(
        str(tmp_path),
        "--preset",
        "small",
        "--set",
        "trainer.early_stopper={name: patience, patience: 3}",
    )
    assert code == 0
    stopper = build_early_stopper(main.calls[0][0].trainer.early_stopper, lower_better=True)
    assert isinstance(stopper, Patience) and stopper.patience == 3


def _error_of(run, capsys, *argv, **kwargs):
    code, main = run(*argv, **kwargs)
    captured = capsys.readouterr()
    assert code == 2
    if "main" not in kwargs:  # a mistake found before main: main never runs
        assert main.calls == []
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--set", "trainer.max_num_step=10"],
            "error: config key 'trainer.max_num_step' is not allowed; "
            "did you mean 'trainer.max_num_steps'?\n",
        ),
        (
            ["--set", "trainer.colour=red"],
            "error: config key 'trainer.colour' is not allowed; "
            "allowed keys: max_num_steps, lr, early_stopper\n",
        ),
        (
            ["--set", "trainr.lr=1"],
            "error: config key 'trainr' is not allowed; did you mean 'trainer'?\n",
        ),
        (
            ["--set", "trainer.max_num_steps=abc"],
            "error: config 'trainer.max_num_steps' = 'abc': Input should be a valid integer, "
            "unable to parse string as an integer\n",
        ),
        (
            ["--set", "trainer.max_num_steps=abc", "--set", "model.dim=[1]"],
            "error: config 'model.dim' = [1]: Input should be a valid integer\n"
            "error: config 'trainer.max_num_steps' = 'abc': Input should be a valid integer, "
            "unable to parse string as an integer\n",
        ),
        (
            ["--set", "data=null"],
            "error: config 'data' = None: Input should be a valid dictionary or instance of "
            "DataSection\n",
        ),
        (
            ["--preset", "smal"],
            "error: unknown preset 'smal'; did you mean 'small'? available presets: small, big\n",
        ),
        (
            ["--set", "trainer.max_num_steps"],
            "error: malformed --set 'trainer.max_num_steps': expected KEY=VALUE, e.g. a.b=10\n",
        ),
        (
            ["--set", "trainer.early_stopper={name: patience, patience: 0}"],
            "error: config 'trainer.early_stopper' = {'name': 'patience', 'patience': 0}: "
            "Value error, 'patience' must be an integer >= 1, got 0\n",
        ),
        (
            ["--set", "trainer.early_stopper={name: nowhere.stoppers:flat}"],
            "error: config 'trainer.early_stopper' = {'name': 'nowhere.stoppers:flat'}: "
            "Value error, cannot import early stopper 'nowhere.stoppers:flat': "
            "ModuleNotFoundError: No module named 'nowhere'\n",
        ),
        (["--bogus"], "error: unrecognized arguments: --bogus (see 'recipe --help')\n"),
    ],
)
def test_bad_config_exits_2_with_one_line_per_problem(run, capsys, tmp_path, argv, message):
    argv = [str(tmp_path / "out"), "--preset", "small", *argv]
    assert _error_of(run, capsys, *argv) == message
    assert not (tmp_path / "out").exists()  # nothing written before the config is valid


def test_missing_required_value(run, capsys, tmp_path):
    err = _error_of(run, capsys, str(tmp_path))
    assert err == "error: config 'data.root' is required but not set\n"


def test_output_dir_required_unless_dump_or_list(run, capsys):
    err = _error_of(run, capsys, "--preset", "small")
    assert err == "error: OUTPUT_DIR is required (see 'recipe --help')\n"


def test_bad_config_files(run, capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    err = _error_of(run, capsys, str(tmp_path), "--config-file", str(missing))
    assert err == f"error: config file '{missing}' not found\n"

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {dim: 3\n")
    err = _error_of(run, capsys, str(tmp_path), "--config-file", str(bad))
    assert err.startswith(f"error: config file '{bad}' is not valid YAML: ")
    assert err.count("\n") == 1

    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n")
    err = _error_of(run, capsys, str(tmp_path), "--config-file", str(listing))
    assert err == f"error: config file '{listing}' must hold a mapping of config keys, not a list\n"


def test_output_dir_not_writable(run, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "out"  # tests run as root, so a path under a regular file is what fails
    err = _error_of(run, capsys, str(out), "--preset", "small")
    assert err == f"error: output directory '{out}' is not writable: Not a directory\n"


def test_user_error_from_main(run, capsys, tmp_path):
    main = Recorder(raises=UserError("data path '/nope' does not exist"))
    err = _error_of(run, capsys, str(tmp_path), "--preset", "small", main=main)
    assert err == "error: data path '/nope' does not exist\n"
    assert len(main.calls) == 1


def test_other_exceptions_propagate(run, tmp_path):
    with pytest.raises(ZeroDivisionError):
        run(str(tmp_path), "--preset", "small", main=Recorder(raises=ZeroDivisionError()))


def test_help_lists_every_config_key_with_its_description(capsys):
    from recipes.lm.config import PRESETS, LMConfig
    from trainer.settings import TrainerSettings

    assert run_recipe(LMConfig, PRESETS, lambda *a: 0, argv=["--help"]) == 0
    out = capsys.readouterr().out
    for name, field in TrainerSettings.model_fields.items():
        assert f"  trainer.{name} = " in out, name
        assert " ".join(field.description.split())[:60] in " ".join(out.split()), name
    assert "  trainer.checkpoint_every_n_steps = 100" in out  # the recipe's own default
    assert "  model.moe_aux_loss_weight = 0.01\n      Weight of the MoE" in out
