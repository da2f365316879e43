"""GRPO on a tiny LLaVA with half the prompts without an image, so that each window holds
one prompt with an image and one without: under DDP on 2 ranks (one rank's rows text only)
the run samples the same completions and trains as one process. Before, a rank whose rows
held no image kept a sampled image placeholder that one process cut (`ImageGenerator`)."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_runs import describe, run_all, torchrun
from test_vlm_grpo import grpo_args, rollouts
from tolerances import reordered_sum_rtol
from transformers import AutoModelForImageTextToText

from gangtrain.tiny.vision import make_tiny_vlm
from gangtrain.tiny.vision_tasks import make_colour_prompts
from trainer.observe.recorders import read_jsonl


def _second_half_without_images(path) -> None:  # noqa: ANN001
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for record in lines[len(lines) // 2:]:
        del record["image"]
        for turn in record["prompt"]:
            turn["content"] = [p for p in turn["content"] if p["type"] != "image"]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_ddp2_with_prompts_without_images_samples_and_trains_as_one_process(tmp_path):
    model = make_tiny_vlm(tmp_path / "llava", "llava")
    train = make_colour_prompts(tmp_path / "data", n=8, name="train.jsonl")
    valid = make_colour_prompts(tmp_path / "data", n=4, seed=1, name="valid.jsonl")
    for path in (train, valid):
        _second_half_without_images(path)
    tiny = (tmp_path, model, train, valid, None)
    procs = run_all({"one": ["recipes.grpo", *grpo_args(tmp_path / "one", tiny)],
                     "ddp2": torchrun("recipes.grpo", *grpo_args(tmp_path / "ddp2", tiny))})
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
    one, two = rollouts(tmp_path / "one"), rollouts(tmp_path / "ddp2")
    windows: dict[int, set] = {}
    for (window, _, _), r in one.items():  # the case happens: a window of each kind of prompt
        windows.setdefault(window, set()).add(r["prompt"][0]["content"][0] == {"type": "image"})
    assert set(map(frozenset, windows.values())) == {frozenset({True, False})}
    assert one.keys() == two.keys()
    for key, r in one.items():  # counter-based sampling: the same tokens on any rank
        assert (r["completion_ids"], r["rewards"]) == \
            (two[key]["completion_ids"], two[key]["rewards"]), key
    linears = sum(isinstance(m, torch.nn.Linear) for m in
                  AutoModelForImageTextToText.from_pretrained(model).modules())
    a, b = (read_jsonl(tmp_path / n / "metrics" / "train.jsonl") for n in ("one", "ddp2"))
    assert any(x["grad_norm"] > 0 for x in a)
    for x, y in zip(a, b, strict=True):  # as test_vlm_grpo's DDP2 test
        rtol = 2 * linears * reordered_sum_rtol(int(x["num_tokens"]))
        for key in ("grad_norm", "kl", "reward"):
            assert y[key] == pytest.approx(x[key], rel=rtol, abs=1e-12), (x["step"], key)
