"""Vision-language models through `python -m recipes.sft`, as a user runs it: a colour only the
pixels show is learnt (LLaVA, Gemma 3, Qwen2-VL) and not from blank images; `--eval-only` is the
answer tokens' NLL computed by hand in float64; OUT/hf loads with AutoModelForImageTextToText and
AutoProcessor (Qwen2-VL: its processor class, as AutoProcessor needs torchvision) and generates; LoRA with the tower frozen keeps the tower's bytes; bad inputs
are one line, exit 2, nothing written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from recipe_runs import describe, run_all
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2VLProcessor
from vlm_reference import answer_nll64, greedy_accuracy, processor_of

from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm
from recipes.sft.recipe import cli
from trainer.observe.recorders import read_jsonl


def sft_args(out: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return [str(out), "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{data / 'train.jsonl'}]",
            "--set", f"data.valid_files=[{data / 'test.jsonl'}]",
            "--set", "model.freeze=[vision_tower]", "--set", "data.seq_len=64",
            "--set", "data.batch_size=4", "--set", "trainer.validate_every_n_steps=60",
            "--set", "trainer.checkpoint_every_n_steps=60", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_recipe")
    models = {f: make_tiny_vlm(root / f, f) for f in ("llava", "gemma3", "qwen2_vl")}
    colour, blank = root / "colour", root / "blank"
    for directory, is_blank in ((colour, False), (blank, True)):
        make_colour_data(directory, n=64, seed=0, name="train.jsonl", blank=is_blank)
        make_colour_data(directory, n=16, seed=7, name="test.jsonl", blank=is_blank,
                         multi_turn_every=0, balanced=True)
    out = {name: root / name for name in ("llava", "gemma3", "qwen2_vl", "blank", "qwen_blank",
                                          "qwen_blank_workers", "lora")}
    procs = run_all({
        "llava": ["recipes.sft", *sft_args(out["llava"], models["llava"], colour)],
        "gemma3": ["recipes.sft", *sft_args(out["gemma3"], models["gemma3"], colour)],
        "qwen2_vl": ["recipes.sft", *sft_args(out["qwen2_vl"], models["qwen2_vl"], colour)],
        "blank": ["recipes.sft", *sft_args(out["blank"], models["llava"], blank,
                                           "--set", "trainer.max_num_steps=30")],
        "qwen_blank": ["recipes.sft", *sft_args(out["qwen_blank"], models["qwen2_vl"], blank,
                                                "--set", "trainer.max_num_steps=30")],
        "qwen_blank_workers": ["recipes.sft", *sft_args(
            out["qwen_blank_workers"], models["qwen2_vl"], blank, "--set",
            "trainer.max_num_steps=30", "--set", "data.num_workers=2")],
        "lora": ["recipes.sft", *sft_args(out["lora"], models["llava"], colour,
                                          "--set", "lora.r=4", "--set",
                                          "trainer.max_num_steps=10")],
    })
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
    return root, models, out, procs


def test_a_colour_only_the_pixels_show_is_learnt(runs):
    root, _, out, procs = runs
    assert "vision 0 trained / 32,714 frozen; projector 2,112 trained" in \
        " ".join(procs["llava"].stdout.split())
    for family in ("llava", "gemma3", "qwen2_vl"):
        accuracy = greedy_accuracy(out[family] / "hf", root / "colour" / "test.jsonl")
        print(f"{family}: held-out greedy accuracy {accuracy:.3f} (chance 0.25)")
        assert accuracy >= 0.8, family
    # Blank images: every prompt is the same, so greedy gives one answer for all of them,
    # right for at most a quarter of the balanced held-out records: chance.
    test = root / "blank" / "test.jsonl"
    answers = Counter(json.loads(line)["messages"][1]["content"][0]["text"]
                      for line in test.read_text().splitlines())
    assert set(answers.values()) == {4}
    for name in ("blank", "qwen_blank"):
        accuracy = greedy_accuracy(out[name] / "hf", test)
        print(f"{name} images: held-out greedy accuracy {accuracy:.3f}")
        assert accuracy <= 0.25, name


def test_images_decoded_in_loader_workers_train_as_in_the_training_process(runs):
    _, _, out, _ = runs
    for section in ("train", "valid"):
        plain = read_jsonl(out["qwen_blank"] / "metrics" / f"{section}.jsonl")
        workers = read_jsonl(out["qwen_blank_workers"] / "metrics" / f"{section}.jsonl")
        key = "loss" if section == "train" else "valid/loss"
        assert [r["step"] for r in plain] == [r["step"] for r in workers]
        # The same micro-batches, bit for bit: the same losses.
        assert [r[key] for r in plain] == [r[key] for r in workers], section


def test_eval_only_is_the_answer_nll_by_hand_in_float64(runs):
    root, models, out, _ = runs
    for family in ("llava", "gemma3", "qwen2_vl"):
        assert cli(sft_args(out[family], models[family], root / "colour", "--eval-only")) == 0
        [record] = read_jsonl(out[family] / "metrics" / "eval.jsonl")
        total, count = answer_nll64(out[family] / "hf", root / "colour" / "test.jsonl")
        gap = abs(record["valid/loss"] / (total / count) - 1)
        print(f"{family}: --eval-only {record['valid/loss']:.9f}, float64 by hand "
              f"{total / count:.9f} over {count} answer tokens, relative gap {gap:.1e}")
        # float32 packed rows against float64 one record at a time: a few eps32 per token.
        assert gap < 1e-5, family


def test_export_loads_with_the_auto_classes_and_keeps_the_processor(runs):
    _, models, out, _ = runs
    exported = out["llava"] / "hf"
    assert (exported / "processor_config.json").is_file()
    processor = AutoProcessor.from_pretrained(exported)
    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.chat_template == AutoProcessor.from_pretrained(models["llava"]).chat_template
    assert type(AutoModelForImageTextToText.from_pretrained(exported)).__name__ == \
        "LlavaForConditionalGeneration"
    # Qwen2-VL: the family's class; its AutoProcessor needs torchvision (the video processor),
    # so the processor loads through its class without one, and names the family's class.
    exported = out["qwen2_vl"] / "hf"
    assert type(AutoModelForImageTextToText.from_pretrained(exported)).__name__ == \
        "Qwen2VLForConditionalGeneration"
    processor = processor_of(exported)
    assert isinstance(processor, Qwen2VLProcessor)
    assert json.loads((exported / "processor_config.json").read_text())["processor_class"] == \
        "Qwen2VLProcessor"
    assert processor.chat_template == processor_of(models["qwen2_vl"]).chat_template


def test_lora_with_the_tower_frozen_keeps_the_tower_bytes(runs):
    _, models, out, _ = runs
    config = json.loads((out["lora"] / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] and all(
        t.startswith("model.language_model.") for t in config["target_modules"])
    before = load_file(models["llava"] / "model.safetensors")
    after = load_file(out["lora"] / "hf" / "model.safetensors")
    tower = [k for k in before if "vision_tower" in k]
    assert tower and all(before[k].numpy().tobytes() == after[k].numpy().tobytes()
                         for k in tower)
    changed = [k for k in before if "q_proj" in k and "vision" not in k
               and not before[k].equal(after[k])]
    assert changed  # the adapters were trained and merged into the language model


def test_bad_images_are_one_line_exit_2_nothing_written(runs, tmp_path, capsys):
    root, models, _, _ = runs
    good = json.loads((root / "colour" / "train.jsonl").read_text().splitlines()[0])
    cases = {
        "url": (["https://example.com/a.png"], "field 'images[0]' is a URL"),
        "missing": (["images/gone.png"], "field 'images[0]': cannot read image"),
    }
    for name, (images, message) in cases.items():
        data = tmp_path / name
        data.mkdir()
        (data / "train.jsonl").write_text(json.dumps({**good, "images": images}) + "\n")
        (data / "test.jsonl").write_text(json.dumps({**good, "images": images}) + "\n")
        out = tmp_path / f"out_{name}"
        code = cli(sft_args(out, models["llava"], data))
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"error: data file {data / 'train.jsonl'}, line 1: {message}" in \
            " ".join(err.split()), err
        assert "Traceback" not in err
        # Nothing of a run (the command line's own lock file aside, as for text data).
        assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}


def test_model_parallel_layouts_are_refused_by_name(runs, tmp_path, capsys):
    root, models, _, _ = runs
    out = tmp_path / "tp"
    code = cli(sft_args(out, models["llava"], root / "colour", "--set", "gangs.tp_size=2"))
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "error: config 'gangs.tp_size' is 2: " in err and \
        "is a vision-language model, trained under data parallelism only" in err, err
