"""A family that needs a spec is one file under `gangtrain.models.hf.families`: StableLM
declares neither a TP plan nor a pipeline layout (transformers 5's `StableLmConfig`), and
its attention reshapes by its own head count. With `families/stablelm.py` alone, its tiny
random model (saved by transformers' own `save_pretrained`) trains through `load_layout`
and the `Trainer` under TP2 and PP2 (2 Gloo ranks) with the losses of one process, within
the tolerance of `test_family_layouts` (measured gaps there 0 to 3e-7)."""

from __future__ import annotations

from functools import partial

import pytest
from model_families import save_tiny
from ranks import run_ranks
from test_family_layouts import assert_equal_losses, train_each

from gangtrain.models.hf.families.stablelm import StableLMSpec
from gangtrain.models.hf.load import build_on_meta
from gangtrain.models.hf.spec import HFSpec, spec_for

FAMILY = ("stablelm",)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {"stablelm": save_tiny("stablelm", tmp_path_factory.mktemp("stablelm") / "m")}


def test_the_family_file_is_found_and_gives_what_transformers_does_not(model_dirs):
    model = build_on_meta(model_dirs["stablelm"])
    assert not getattr(model.config, "base_model_tp_plan", None)  # why the file exists
    assert not getattr(model.config, "base_model_pp_plan", None)
    spec = spec_for(model)
    assert type(spec) is StableLMSpec and spec.name == "hf:stablelm"
    assert type(spec_for(model.config)) is StableLMSpec  # from config.json, before a build
    plan = spec.tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert len(spec.decoder_layers(model)) == 4
    with pytest.raises(Exception, match="declares no tensor-parallel plan"):
        HFSpec("stablelm").tp_plan(model)  # the generic spec refuses it by name


@pytest.fixture(scope="module")
def one_process(model_dirs):
    return run_ranks(partial(train_each, model_dirs, FAMILY), world_size=1)[0]


@pytest.mark.parametrize("layout", [
    pytest.param({"tp_size": 2, "data_parallel": "ddp"}, id="tp2"),
    pytest.param({"pp_size": 2, "data_parallel": "ddp"}, id="pp2"),
])
def test_a_family_of_one_file_trains_on_two_ranks_as_on_one_process(model_dirs, one_process,
                                                                    layout):
    one = one_process
    assert "refused" not in one["stablelm"], one
    results = run_ranks(partial(train_each, model_dirs, FAMILY, **layout), world_size=2,
                        timeout=300)[0]
    assert_equal_losses(results, one, str(layout))
