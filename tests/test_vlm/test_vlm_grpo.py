"""GRPO prompts with images (TRL's VLM prompt-only format: prompt turns with an image part,
`image`) on a tiny LLaVA: the generator's per-token log-probabilities (the engine's prefill
with the images, then its KV cache) equal the trained forward's (the whole rows with their
images) within 1e-5, and a blank image changes them (the image reaches generation); a short
run of `python -m recipes.grpo` goes end to end (rewards on the completions, the KL to a
reference that sees the image, validation, OUT/hf) and under DDP on 2 ranks samples the same
completions and trains as one process; bad prompts are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recipe_runs import describe, run_all, torchrun
from tolerances import reordered_sum_rtol
from transformers import AutoModelForImageTextToText, AutoProcessor

from gangtrain.data.vision_prompts import join_inputs, placeholder_ids, read_image_prompts
from gangtrain.rl.generation import sample_seed
from gangtrain.rl.image_generation import ImageGenerator
from gangtrain.tiny.vision import make_tiny_vlm
from gangtrain.tiny.vision_tasks import make_colour_prompts
from recipes.grpo.recipe import cli
from trainer.observe.recorders import read_jsonl
from units.online_rl.token_logps import token_logps
from units.online_rl.window import Slice, slice_tensors

REWARD = "gangtrain.tiny.vision_tasks:colour_reward"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_grpo")
    model = make_tiny_vlm(root / "llava", "llava")
    train = make_colour_prompts(root / "data", n=8, name="train.jsonl")
    valid = make_colour_prompts(root / "data", n=4, seed=1, name="valid.jsonl")
    blank = make_colour_prompts(root / "blank", n=8, name="train.jsonl", blank=True)
    return root, model, train, valid, blank


def generate(model, processor, path: Path, max_new_tokens: int = 6):  # noqa: ANN001, ANN201
    """(prompt set, completions) of every prompt of `path`, sampled at temperature 1."""
    prompts = read_image_prompts([str(path)], processor, "llava", max_prompt_tokens=200)
    generator = ImageGenerator(model, stop_ids=[processor.tokenizer.eos_token_id],
                               pad_id=processor.tokenizer.pad_token_id,
                               max_new_tokens=max_new_tokens, temperature=1.0,
                               placeholder_ids=placeholder_ids(processor))
    rows = list(range(len(prompts)))
    completions = generator.generate([prompts[i].ids for i in rows],
                                     [sample_seed(0, 0, i, 0) for i in rows],
                                     inputs=[prompts.model_inputs(i) for i in rows])
    return prompts, completions


def trained_logps(model, processor, prompts, completions, with_images: bool = True):  # noqa: ANN001, ANN201
    """The completions' token log-probs from one forward of the whole rows, as the GRPO
    unit trains them (`token_logps` of `units.online_rl.token_logps` on a `Slice`)."""
    ids, mask, scored = slice_tensors([p.ids for p in prompts.prompts],
                                      [c.ids for c in completions],
                                      processor.tokenizer.pad_token_id)
    s = Slice(ids, mask, scored, torch.zeros(len(completions)),
              torch.ones(len(completions), dtype=torch.bool))
    if with_images:
        s.inputs = join_inputs([prompts.model_inputs(i) for i in range(len(prompts))])
    with torch.no_grad():
        return token_logps(model, s, 1.0, chunk_size=None)[0]


def test_generator_log_probs_equal_the_trained_forward_with_the_image(tiny):
    _, model_dir, train, _, blank = tiny
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    prompts, completions = generate(model, processor, train)
    assert sum(len(c.ids) for c in completions) > len(completions)  # tokens to compare
    sampled = torch.tensor([lp for c in completions for lp in c.logprobs])
    trained = trained_logps(model, processor, prompts, completions)
    gap = (sampled - trained).abs().max().item()
    print(f"{len(sampled)} tokens: generator vs trained forward, largest gap {gap:.1e}")
    assert gap <= 1e-5
    # Without its pixels the same rows score otherwise: the image is what they saw.
    assert (sampled - trained_logps(model, processor, prompts, completions, False)
            ).abs().max() > 1e-3
    # The same prompts with grey images: the generator's first tokens are scored otherwise.
    _, grey = generate(model, processor, blank)
    first = [(c.logprobs[0], g.logprobs[0]) for c, g in zip(completions, grey, strict=True)
             if c.ids and c.ids[:1] == g.ids[:1]]
    assert first and all(abs(a - b) > 1e-4 for a, b in first)


def test_a_completion_ends_before_a_sampled_image_token(tiny):
    _, model_dir, train, _, _ = tiny
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    image = processor.image_token_id
    # A policy that samples the image placeholder second: the trained forward would look
    # for that image's pixels, so the completion keeps the first token only, truncated.
    def after_one(module, args, output):  # noqa: ANN001, ANN202
        after_one.calls += 1
        if after_one.calls > 1:  # decode steps (the prefill samples the first token)
            output[..., image] += 1e4
        return output
    after_one.calls = 0
    model.get_output_embeddings().register_forward_hook(after_one)
    _, completions = generate(model, processor, train)
    # (a row whose first token was already the placeholder, as a random model may, keeps none)
    assert all(len(c.ids) == len(c.logprobs) <= 1 and c.truncated and image not in c.ids
               for c in completions), [(c.ids, c.truncated) for c in completions]
    assert sum(len(c.ids) for c in completions) >= len(completions) // 2


def grpo_args(out: Path, tiny, *extra: str) -> list[str]:
    _, model, train, valid, _ = tiny
    return [str(out), "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{train}]", "--set", f"data.valid_files=[{valid}]",
            "--set", f"rewards=[{REWARD}]", "--set", "generation.max_new_tokens=4",
            "--set", "loss.beta=0.04", "--set", "trainer.max_num_steps=3",
            "--set", "trainer.validate_every_n_steps=3", "--set", "gangs.timeout_s=60",
            "--set", "trainer.checkpoint_every_n_steps=3",
            "--set", "trainer.publish_metrics_every_n_steps=1", *extra]


@pytest.fixture(scope="module")
def runs(tiny):
    """The recipe on one process and under DDP on 2 (the tiny preset's data parallelism)."""
    root = tiny[0]
    procs = run_all({
        "one": ["recipes.grpo", *grpo_args(root / "one", tiny)],
        "ddp2": torchrun("recipes.grpo", *grpo_args(root / "ddp2", tiny))})
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr, name
    return {name: root / name for name in procs}


def rollouts(out: Path) -> dict[tuple[int, int, int], dict]:
    return {(r["window"], r["prompt_index"], r["sample_index"]): r
            for path in sorted((out / "rollouts").glob("step_*.jsonl"))
            for r in map(json.loads, path.read_text().splitlines())}


def test_a_short_grpo_run_with_images_goes_end_to_end(runs):
    out = runs["one"]
    train = {r["step"]: r for r in read_jsonl(out / "metrics" / "train.jsonl")}
    assert set(train) == {1, 2, 3} and all(r["kl"] >= 0 for r in train.values())
    valid = [r for path in (out / "metrics").glob("valid*.jsonl") for r in read_jsonl(path)]
    assert any("valid/reward" in r for r in valid)
    records = list(rollouts(out).values())
    assert records and all(r["prompt"][0]["content"][0] == {"type": "image"} for r in records)
    assert all(set(r["rewards"].values()) <= {0.0, 1.0} for r in records)
    assert (out / "hf" / "processor_config.json").is_file()


def test_ddp2_samples_and_trains_as_one_process(tiny, runs):
    # A VLM under DDP: the tower's unused parameters (CLIP's post-layernorm) are looked for.
    one, two = rollouts(runs["one"]), rollouts(runs["ddp2"])
    assert one.keys() == two.keys()
    for key, r in one.items():  # counter-based sampling: the same tokens on any rank
        assert (r["completion_ids"], r["rewards"]) == \
            (two[key]["completion_ids"], two[key]["rewards"]), key
    linears = sum(isinstance(m, torch.nn.Linear) for m in
                  AutoModelForImageTextToText.from_pretrained(tiny[1]).modules())
    a, b = (read_jsonl(runs[n] / "metrics" / "train.jsonl") for n in ("one", "ddp2"))
    for x, y in zip(a, b, strict=True):
        # Rows batched otherwise (8 on one rank, 4 on each of two) and gradients summed in
        # another order: each linear map's sums, forward and backward, within
        # `reordered_sum_rtol` of the step's tokens.
        rtol = 2 * linears * reordered_sum_rtol(int(x["num_tokens"]))
        for key in ("grad_norm", "kl", "reward"):
            assert y[key] == pytest.approx(x[key], rel=rtol, abs=1e-12), (x["step"], key)


def test_bad_prompts_are_one_line_exit_2(tiny, tmp_path, capsys):
    _, model_dir, train, _, _ = tiny
    good = json.loads(train.read_text().splitlines()[0])
    image = train.parent / good["image"]
    cases = {
        "missing": ({**good, "image": "images/gone.png"}, "field 'images[0]': cannot read image"),
        "url": ({**good, "image": "https://example.com/a.png"}, "field 'images[0]' is a URL"),
        "count": ({**good, "image": None, "images": [good["image"]] * 2},
                  "field 'images' holds 2 image(s), 'prompt' has 1 image part(s)"),
        "text": ({**good, "prompt": "What colour ?"}, "field 'prompt' holds str"),
    }
    for name, (record, message) in cases.items():
        data = tmp_path / name
        (data / "images").mkdir(parents=True)
        (data / good["image"]).write_bytes(image.read_bytes())
        (data / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        out = tmp_path / f"out_{name}"
        code = cli([str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
                    "--set", f"data.files=[{data / 'train.jsonl'}]",
                    "--set", f"rewards=[{REWARD}]"])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2, (name, err)
        assert f"error: data file {data / 'train.jsonl'}, line 2: {message}" in err, (name, err)
        assert "Traceback" not in err
        assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}, name
