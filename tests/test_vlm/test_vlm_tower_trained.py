"""A tiny LLaVA trained with its vision tower, configured as LLaVA-1.5 (features from the
tower's second-last layer: its last layer and `post_layernorm` never get a gradient), half
the records without an image: DDP and FSDP2 on 2 ranks track one process (DDP looks for
unused parameters; a rank without an image runs the dummy pass, which touches exactly what
an image does); the parameters without a gradient stay as loaded, with no optimizer state;
and a run resumed from the step-10 checkpoint ends bit for bit where the run never stopped
ends (it failed with "Missing key ... post_layernorm.weight.step")."""

from __future__ import annotations

import json
import shutil

import torch
from killed_runs import assert_same_state, checkpoint_state
from recipe_runs import describe, run_all, run_module
from safetensors.torch import load_file
from test_vlm_layouts import _with_text_only_records, assert_track_one_process
from test_vlm_recipe import sft_args

from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm

UNUSED = ("vision_tower.post_layernorm.", "vision_tower.encoder.layers.1.")
"""The tiny tower's 2 layers: with `vision_feature_layer=-2` the last is never used."""


def test_llava_with_its_tower_trained_under_ddp_fsdp_and_resumed(tmp_path):
    model = make_tiny_vlm(tmp_path / "llava", "llava")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
    data = tmp_path / "colour"
    make_colour_data(data, n=32, seed=0, name="train.jsonl")
    make_colour_data(data, n=8, seed=7, name="test.jsonl", multi_turn_every=0)
    for name in ("train.jsonl", "test.jsonl"):
        _with_text_only_records(data / name)
    settings = ("--set", "model.freeze=[]", "--set", "trainer.max_num_steps=20",
                "--set", "trainer.validate_every_n_steps=10",
                "--set", "trainer.checkpoint_every_n_steps=10",
                "--set", "trainer.keep_last_n_checkpoints=2",
                "--set", "trainer.keep_best_n_checkpoints=null", "--set", "gangs.timeout_s=30",
                "--set", "data.batch_size=2", "--set", "data.valid_batch_size=2")

    def torchrun(name: str, *extra: str) -> list[str]:
        return ["torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                "recipes.sft", *sft_args(tmp_path / name, model, data, *settings, *extra)]

    one = ["recipes.sft", *sft_args(tmp_path / "one", model, data, *settings)]
    procs = run_all({"one": one, "ddp2": torchrun("ddp2", "--set", "trainer.data_parallel=ddp"),
                     "fsdp2": torchrun("fsdp2", "--set", "trainer.data_parallel=fsdp")})
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
    assert "vision 32,714 trained / 0 frozen" in " ".join(procs["one"].stdout.split())
    assert_track_one_process(tmp_path, ("ddp2", "fsdp2"))

    final = checkpoint_state(tmp_path / "one" / "checkpoints" / "step_20")
    loaded = load_file(model / "model.safetensors")
    unused = [name for name in loaded if name.startswith(UNUSED)]
    assert unused
    for name in unused:
        assert torch.equal(final[f"/model/model.{name}"], loaded[name]), name
        assert not any(key.startswith(f"/optimizer/state.model.{name}") for key in final), name

    # The run stopped after its step-10 checkpoint, started again with the same command.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "one", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_20")
    shutil.rmtree(resumed / "hf")
    command = [arg if arg != str(tmp_path / "one") else str(resumed) for arg in one]
    proc = run_module(*command)
    assert proc.returncode == 0, describe(proc)
    assert "resumed from" in proc.stderr and "step_10" in proc.stderr, proc.stderr
    assert_same_state(final, checkpoint_state(resumed / "checkpoints" / "step_20"))
