"""load_config: merge precedence, overrides and error formatting (no command line)."""

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from gangtrain.app.cli import format_validation_error, load_config, parse_override
from trainer.errors import UserError


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_fill_what_is_not_set(config_type, presets):
    config = load_config(config_type, presets, overrides=["data.root=/x"])
    assert config.model.dim == 8
    assert config.model.layers == [1, 2]
    assert config.trainer.max_num_steps == 50  # the section's default instance is kept
    assert config.trainer.early_stopper is None
    assert config.data.root == "/x"


def test_preset_beats_defaults_and_drops_doc(config_type, presets):
    config = load_config(config_type, presets, preset="small")
    assert config.model.dim == 4
    assert config.data.root == "/small"
    assert config.model.name == "tiny"  # merged, not replaced


def test_files_beat_preset_and_later_files_beat_earlier(config_type, presets, tmp_path):
    first = _write(tmp_path / "a.yaml", {"model": {"dim": 16, "name": "a"}, "trainer": {"lr": 0.5}})
    second = _write(tmp_path / "b.yaml", {"model": {"dim": 32}})
    config = load_config(config_type, presets, preset="small", config_files=[first, second])
    assert config.model.dim == 32  # second file
    assert config.model.name == "a"  # first file, untouched by the second
    assert config.trainer.lr == 0.5
    assert config.data.root == "/small"  # preset


def test_overrides_beat_files_and_apply_in_order(config_type, presets, tmp_path):
    file = _write(tmp_path / "a.yaml", {"trainer": {"max_num_steps": 7}, "data": {"root": "/f"}})
    config = load_config(
        config_type,
        presets,
        preset="big",
        config_files=[file],
        overrides=["trainer.max_num_steps=10", "data.root=/o", "trainer.max_num_steps=11"],
    )
    assert config.trainer.max_num_steps == 11
    assert config.data.root == "/o"
    assert config.model.dim == 64  # preset


def test_lists_are_replaced_not_merged(config_type, presets, tmp_path):
    file = _write(tmp_path / "a.yaml", {"model": {"layers": [8]}, "data": {"root": "/x"}})
    config = load_config(config_type, presets, preset="big", config_files=[file])
    assert config.model.layers == [8]
    config = load_config(
        config_type, presets, preset="big", overrides=["model.layers.1=9", "data.root=/x"]
    )
    assert config.model.layers == [4, 9, 4]


def test_null_then_mapping_replaces_a_mapping(config_type, presets):
    base = ["data.root=/x", "trainer.early_stopper={name: patience, patience: 3}"]
    merged = ["trainer.early_stopper={min_delta: 0.1}"]
    config = load_config(config_type, presets, overrides=base + merged)
    assert config.trainer.early_stopper.kwargs == {"patience": 3, "min_delta": 0.1}

    replaced = ["trainer.early_stopper=null", "trainer.early_stopper={name: threshold, value: 1}"]
    config = load_config(config_type, presets, overrides=base + replaced)
    assert config.trainer.early_stopper.name == "threshold"
    assert config.trainer.early_stopper.kwargs == {"value": 1}


def test_early_stopper_from_flow_mapping(config_type, presets):
    config = load_config(
        config_type,
        presets,
        preset="small",
        overrides=["trainer.early_stopper={name: patience, patience: 3}"],
    )
    assert config.trainer.early_stopper.name == "patience"
    assert config.trainer.early_stopper.kwargs == {"patience": 3}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("trainer.max_num_steps=10", (["trainer", "max_num_steps"], 10)),
        ("data.root=/x", (["data", "root"], "/x")),
        ("x=null", (["x"], None)),
        ("a.b={name: patience, patience: 3}", (["a", "b"], {"name": "patience", "patience": 3})),
        ("a=[1, 2]", (["a"], [1, 2])),
        ("a='10'", (["a"], "10")),
        ("a=b=c", (["a"], "b=c")),
        ("a=", (["a"], "")),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["trainer.max_num_steps", "=3", "a..b=1", "a.=1"])
def test_parse_override_rejects_malformed(text):
    with pytest.raises(ValueError, match=f"malformed --set '{text}'"):
        parse_override(text)


def test_load_config_errors_are_user_errors(config_type, presets):
    with pytest.raises(UserError) as info:
        load_config(config_type, presets, overrides=["data.root=/x", "trainer.max_num_step=1"])
    assert str(info.value) == (
        "config key 'trainer.max_num_step' is not allowed; did you mean 'trainer.max_num_steps'?"
    )
    assert isinstance(info.value.__cause__, ValidationError)

    with pytest.raises(UserError, match="'model.layers' is a list of 2 items; '5' is not an index"):
        load_config(config_type, presets, overrides=["model.layers.5=1"])


def test_format_validation_error_lines(config_type):
    data = {"model": {"dim": "x", "colour": 1}, "trainer": {"zzz": 1}}
    with pytest.raises(ValidationError) as info:
        config_type.model_validate(data)
    assert format_validation_error(info.value, config_type).splitlines() == [
        "config 'model.dim' = 'x': Input should be a valid integer, unable to parse string as an "
        "integer",
        "config key 'model.colour' is not allowed; allowed keys: name, dim, layers",
        "config key 'trainer.zzz' is not allowed; allowed keys: max_num_steps, lr, early_stopper",
        "config 'data' is required but not set",
    ]


def test_format_validation_error_with_prefix_and_unions():
    class A(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 1

    class B(BaseModel):
        model_config = ConfigDict(extra="forbid")
        width: int = 1

    class Section(BaseModel):
        model_config = ConfigDict(extra="forbid")
        shape: A | B = A()
        items: list[A] = []

    with pytest.raises(ValidationError) as info:
        Section.model_validate({"shape": {"sise": 1}, "items": [{"size": "big"}]})
    assert format_validation_error(info.value, Section, prefix="trainer").splitlines() == [
        "config key 'trainer.shape.sise' is not allowed; did you mean 'trainer.shape.size'?",
        "config key 'trainer.shape.sise' is not allowed; allowed keys: width",
        "config 'trainer.items.0.size' = 'big': Input should be a valid integer, unable to parse "
        "string as an integer",
    ]
