"""`python -m recipes.finetune ... --set lora.r=8` as users run it: the tiny Llama of
`gangtrain.tiny.corpus` fine-tuned with LoRA adapters; a run killed twice (once mid-save)
ends in the state of a run never stopped; `--eval-only` scores the best adapters again; the
merged OUT/hf/ carries the tokenizer and generation config; mistakes, and a base changed
under a resumed run, are one clear line."""

from __future__ import annotations

import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly
from recipe_runs import REPO, describe, recipe_env, run_module
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from gangtrain.tiny.corpus import make_tiny_model, write_tiny_corpus
from recipes.finetune.recipe import cli
from trainer.observe.recorders import read_jsonl

STEPS = 20
LORA = ("--set", "lora.r=8", "--set", "lora.alpha=16",
        "--set", "lora.target_modules=[q_proj,v_proj,down_proj]",
        "--set", "optimizer.lr=5.0e-2", "--set", f"trainer.max_num_steps={STEPS}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    base = tmp_path_factory.mktemp("lora_recipe")
    return make_tiny_model(base / "model"), write_tiny_corpus(base / "data")


def lora_args(out: Path, model: Path, files: list[Path], *extra: str) -> list:
    return [str(out), "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{','.join(map(str, files))}]", *LORA, *extra]


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_straight") / "out"
    proc = run_module("recipes.finetune", *lora_args(out, *tiny))
    assert proc.returncode == 0, describe(proc)
    # The console names what trains and what is frozen, which add up to the total.
    counts = re.search(r"([\d,]+) parameters, 3,328 trained \(LoRA adapters; ([\d,]+) frozen\)",
                       proc.stdout)
    assert counts, proc.stdout
    total, frozen = (int(c.replace(",", "")) for c in counts.groups())
    assert total == frozen + 3328
    assert f"its LoRA adapters in peft's format: {out / 'adapter'}" in proc.stdout
    return out


def valid_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["valid/loss"] for r in read_jsonl(out / "metrics" / "valid.jsonl")}


def test_lora_run_learns_exports_and_evaluates_again(straight, tiny):
    """The adapters lower the held-out loss; OUT/hf/ is the merged model with the
    pretrained tokenizer and generation config; `--eval-only` loads the best adapters onto
    the base again and gets the recorded score."""
    valid = valid_losses(straight)
    best_step = min(valid, key=valid.get)
    assert valid[best_step] < valid[10] - 0.005, valid  # measured 5.900 -> 5.887
    for name in ("tokenizer.json", "generation_config.json"):
        assert (straight / "hf" / name).read_bytes() == (tiny[0] / name).read_bytes()
    text = "Return a new dictionary"
    assert (AutoTokenizer.from_pretrained(straight / "hf")(text)["input_ids"]
            == AutoTokenizer.from_pretrained(tiny[0])(text)["input_ids"])
    merged = AutoModelForCausalLM.from_pretrained(straight / "hf")
    base = AutoModelForCausalLM.from_pretrained(tiny[0])
    changed = {name for (name, p), q in zip(merged.named_parameters(), base.parameters())
               if not torch.equal(p, q)}
    assert changed and all(name.split(".")[-2] in ("q_proj", "v_proj", "down_proj")
                           for name in changed), changed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli(lora_args(straight, *tiny, "--eval-only")) == 0
    finally:
        torch.set_num_threads(threads)
    [record] = read_jsonl(straight / "metrics" / "eval.jsonl")
    assert record["step"] == best_step
    assert record["valid/loss"] == pytest.approx(valid[best_step], rel=1e-6)


def command(out: Path, tiny) -> list[str]:
    return [sys.executable, "-m", "recipes.finetune", *map(str, lora_args(out, *tiny))]


def test_killed_lora_run_resumes_bit_for_bit(straight, tiny, tmp_path):
    killed = tmp_path / "killed"
    hits = kill_repeatedly(command(killed, tiny), killed / "checkpoints", 2, random.Random(0),
                           final_step=STEPS, cwd=REPO, env=recipe_env())
    assert hits >= 1
    proc = warm_launch.run(command(killed, tiny), cwd=REPO, env=recipe_env(), timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert "resumed from" in proc.stderr
    final = f"checkpoints/step_{STEPS}"
    state = checkpoint_state(killed / final)
    assert_same_state(checkpoint_state(straight / final), state)
    assert all(".lora_" in key for key in state if key.startswith("/model/"))
    assert valid_losses(killed) == valid_losses(straight)
    for name in ("hf/model.safetensors", "adapter/adapter_model.safetensors"):
        assert (killed / name).read_bytes() == (straight / name).read_bytes(), name


def test_lora_mistakes_are_one_clear_line(tiny, tmp_path, capsys):
    """Bad settings, and a base rewritten under a run that then resumes, exit 2 naming the
    setting or the file (in this process: `cli` is the command's main)."""
    model, files = tiny
    base = shutil.copytree(model, tmp_path / "base")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli(lora_args(tmp_path / "resumed", base, files,
                             "--set", "trainer.max_num_steps=10")) == 0
        changed = LlamaForCausalLM.from_pretrained(base)
        with torch.no_grad():
            changed.lm_head.weight[0, 0] += 1.0
        changed.save_pretrained(base)
        cases = {
            "lora.r=0": (lora_args(tmp_path / "o1", model, files, "--set", "lora.r=0"),
                         "lora.r"),
            "unknown target": (
                lora_args(tmp_path / "o2", model, files, "--set", "lora.target_modules=[qkv]"),
                "error: lora.target_modules: no layer of LlamaForCausalLM is named 'qkv'"),
            "changed base": (
                lora_args(tmp_path / "resumed", base, files),
                f"error: the base model changed since checkpoint "
                f"{tmp_path / 'resumed' / 'checkpoints' / 'step_10'} was saved: "
                f"{base.resolve() / 'model.safetensors'} has"),
        }
        capsys.readouterr()
        for name, (args, expected) in cases.items():
            assert cli(args) == 2, name
            err = capsys.readouterr().err
            assert expected in err and "Traceback" not in err, f"{name}: {err}"
    finally:
        torch.set_num_threads(threads)
