"""Preference pairs with images (TRL's VLM format: prompt turns with an image part, chosen,
rejected, images) on a tiny LLaVA: the DPO unit's loss and gradient on a batch the data path
made equal a float64 hand computation (HF model and processor as a user runs them, the answer
tokens found from the ids, no gangtrain code) with a reference that differs from the policy;
through `python -m recipes.preference`, the step-1 loss, log-probs and gradient norm and,
after training, `--eval-only` against the base as reference equal it too; a blank image
gives other log-probs than the real one, for the policy and the reference (the image reaches
both); bad inputs are one line, exit 2, nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from PIL import Image
from recipe_runs import describe, metric_records, run_all
from tolerances import reordered_sum_rtol
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_reference import answer_positions

from gangtrain.data.preference import PairFields
from gangtrain.data.vision_pairs import ImagePairs, read_pairs
from gangtrain.tiny.vision import make_tiny_vlm
from gangtrain.tiny.vision_tasks import make_colour_pairs
from recipes.preference.recipe import cli
from units.metrics import MetricBag
from units.preference import PreferenceLoss, PreferenceUnit

BETA = 0.1
NUM_TRAIN = 8  # one global batch: step 1 sees every training pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_preference")
    model = make_tiny_vlm(root / "llava", "llava")
    train = make_colour_pairs(root / "data", n=NUM_TRAIN, name="train.jsonl")
    valid = make_colour_pairs(root / "data", n=8, seed=1, name="valid.jsonl")
    return root, model, train, valid


def pair_args(out: Path, tiny, *extra: str) -> list[str]:
    _, model, train, valid = tiny
    return [str(out), "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{train}]", "--set", f"data.valid_files=[{valid}]",
            "--set", f"data.batch_size={NUM_TRAIN}", "--set", "trainer.max_num_steps=3",
            "--set", "trainer.publish_metrics_every_n_steps=1", "--set", "optimizer.lr=1e-2",
            *extra]


# --- the float64 hand computation -------------------------------------------------------

def load64(directory: Path):  # noqa: ANN201
    return AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float64).eval()


def side_logp64(model, processor, turns: list, images: list) -> torch.Tensor:  # noqa: ANN001
    """Sum of log p(token | before) over the answer's tokens (after `<|assistant|>` through
    its `<|end|>`), the image(s) in the input, float64."""
    text = processor.apply_chat_template(turns, tokenize=False)
    inputs = processor(text=[text], images=[images], return_tensors="pt",
                       add_special_tokens=False)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    logits = model(**inputs).logits[0]
    ids = inputs["input_ids"][0]
    token = processor.tokenizer.convert_tokens_to_ids
    at = torch.tensor(answer_positions(ids.tolist(), token("<|assistant|>"), token("<|end|>")))
    return -F.cross_entropy(logits[at - 1], ids[at], reduction="sum")


def pairs_of(path: Path) -> list[tuple[list, list, list, list]]:
    """(prompt, chosen, rejected, opened images) of each record."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        images = [Image.open(path.parent / f).convert("RGB") for f in r["images"]]
        out.append((r["prompt"], r["chosen"], r["rejected"], images))
    return out


def dpo_by_hand(policy, reference, processor, path: Path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The mean DPO loss (sigmoid, beta 0.1) over the file's pairs and its means of the
    policy's summed log-probs, float64; the loss keeps its graph to the policy."""
    losses, chosen, rejected = [], [], []
    for prompt, c, r, images in pairs_of(path):
        pc, pr = (side_logp64(policy, processor, [*prompt, a], images) for a in (c[0], r[0]))
        with torch.no_grad():
            rc, rr = (side_logp64(reference, processor, [*prompt, a], images)
                      for a in (c[0], r[0]))
        losses.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
        chosen.append(pc.detach())
        rejected.append(pr.detach())
    return {"loss": torch.stack(losses).mean(), "logps/chosen": torch.stack(chosen).mean(),
            "logps/rejected": torch.stack(rejected).mean()}


def float32_rtol(model, batch: dict, gradient: bool = False) -> float:  # noqa: ANN001
    """float32 against float64, relative: each of the model's linear maps (at most that many
    reductions one after another) rounds a sum, within `reordered_sum_rtol` of its length
    of the exact one: in the forward at most the widest map's inputs, the vocabulary or the
    row's length; in a weight's gradient every token of the batch."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    length = max(max(m.in_features for m in linears), max(m.out_features for m in linears),
                 batch["input_ids"].shape[1])
    if not gradient:
        return len(linears) * reordered_sum_rtol(length)
    return 2 * len(linears) * reordered_sum_rtol(max(length, batch["input_ids"].numel()))


# --- the unit, on a batch of the data path ------------------------------------------------

def test_dpo_loss_and_gradient_with_images_equal_float64_by_hand(tiny):
    root, model_dir, train, _ = tiny
    processor = AutoProcessor.from_pretrained(model_dir)
    policy = AutoModelForImageTextToText.from_pretrained(model_dir)
    reference = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    with torch.no_grad():  # a reference that is not the policy: the loss is not ln 2
        torch.manual_seed(1)
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pairs = read_pairs(train, PairFields())
    batch = ImagePairs(pairs, processor, "llava").batch(list(range(len(pairs))),
                                                       processor.tokenizer.pad_token_id)
    assert batch["pixel_values"].shape[0] == 2 * len(pairs)  # each side sees its image
    unit = PreferenceUnit(policy, PreferenceLoss("dpo", BETA), reference)
    metrics = MetricBag()
    loss, count = unit(batch, metrics)
    (loss / count).backward()

    policy64, reference64 = load64(model_dir), reference.double()
    hand = dpo_by_hand(policy64, reference64, processor, train)
    hand["loss"].backward()
    rtol, grad_rtol = float32_rtol(policy, batch), float32_rtol(policy, batch, gradient=True)
    print(f"loss {loss.item() / count:.9f} by hand {hand['loss'].item():.9f}; rtol {rtol:.1e}")
    assert abs(hand["loss"].item() - math.log(2)) > 1e-3  # the reference differs
    assert loss.item() / count == pytest.approx(hand["loss"].item(), rel=rtol)
    named64 = dict(policy64.named_parameters())
    # One scale for every entry: a gradient that is zero by symmetry (the attention keys'
    # bias) is rounding noise of the gradients flowing through it, not of its own size.
    scale = max(p.grad.abs().max().item() for p in policy64.parameters() if p.grad is not None)
    worst = 0.0
    for name, p in policy.named_parameters():
        g64 = named64[name].grad
        if g64 is None:  # unused by the forward (CLIP's post-layernorm)
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad.double(), g64, rtol=grad_rtol,
                                   atol=grad_rtol * scale, msg=name)
        worst = max(worst, (p.grad.double() - g64).abs().max().item() / scale)
    print(f"gradient: worst gap {worst:.1e} of the largest entry")


def test_the_image_reaches_the_policy_and_the_reference(tiny):
    root, model_dir, train, _ = tiny
    processor = AutoProcessor.from_pretrained(model_dir)
    policy = AutoModelForImageTextToText.from_pretrained(model_dir)
    reference = AutoModelForImageTextToText.from_pretrained(model_dir)
    blank_dir = root / "blank"
    blank = make_colour_pairs(blank_dir, n=NUM_TRAIN, name="train.jsonl", blank=True)
    unit = PreferenceUnit(policy, PreferenceLoss("dpo", BETA), reference)
    scores = {}
    for name, path in (("real", train), ("blank", blank)):
        pairs = read_pairs(path, PairFields())
        batch = ImagePairs(pairs, processor, "llava").batch(list(range(len(pairs))),
                                                           processor.tokenizer.pad_token_id)
        with torch.no_grad():
            scores[name] = (unit.policy_logps(batch)[0], unit.reference_logps(batch))
    # Same prompts and answers (same seed), other pixels: every row scores otherwise.
    for i, who in enumerate(("policy", "reference")):
        gap = (scores["real"][i] - scores["blank"][i]).abs()
        print(f"{who}: |real - blank| per row, smallest {gap.min().item():.2e}")
        assert (gap > 1e-4).all(), who


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_other_families_score_each_side_as_float64_by_hand(family, tmp_path):
    # Gemma 3's token_type_ids (two-way attention within an image) and Idefics3's images
    # laid out per batch reach the model with each side.
    model_dir = make_tiny_vlm(tmp_path / family, family)
    path = make_colour_pairs(tmp_path / "data", n=4, name="pairs.jsonl")
    processor = AutoProcessor.from_pretrained(model_dir)
    policy = AutoModelForImageTextToText.from_pretrained(model_dir)
    pairs = read_pairs(path, PairFields())
    batch = ImagePairs(pairs, processor, family).batch(list(range(len(pairs))),
                                                      processor.tokenizer.pad_token_id)
    with torch.no_grad():
        found = PreferenceUnit(policy, PreferenceLoss("simpo")).policy_logps(batch)[0]
        model64 = load64(model_dir)
        records = pairs_of(path)
        hand = torch.stack([side_logp64(model64, processor, [*prompt, sides[k][0]], images)
                            for k in (0, 1) for prompt, *sides, images in records])
    rtol = float32_rtol(policy, batch)
    print(f"{family}: largest relative gap {((found.double() - hand) / hand).abs().max():.1e}")
    torch.testing.assert_close(found.double(), hand, rtol=rtol, atol=0)


# --- through the recipe --------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tiny):
    root = tiny[0]
    out = root / "run"
    proc = run_all({"dpo": ["recipes.preference", *pair_args(out, tiny)]})["dpo"]
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stderr
    assert "data train: 8 image pairs of 8; 0 dropped" in proc.stdout, proc.stdout
    return out, proc


def test_recipe_step_one_equals_float64_by_hand(tiny, run):
    _, model_dir, train, _ = tiny
    out, _ = run
    step1 = metric_records(out, "train")[1]
    processor = AutoProcessor.from_pretrained(model_dir)
    policy64 = load64(model_dir)
    hand = dpo_by_hand(policy64, load64(model_dir), processor, train)
    hand["loss"].backward()
    grad_norm = torch.cat([p.grad.flatten() for p in policy64.parameters()
                           if p.grad is not None]).norm().item()
    pairs = read_pairs(train, PairFields())
    batch = ImagePairs(pairs, processor, "llava").batch(list(range(len(pairs))), 0)
    rtol, grad_rtol = float32_rtol(policy64, batch), float32_rtol(policy64, batch, True)
    print(f"step 1: grad_norm {step1['grad_norm']:.9f}, by hand {grad_norm:.9f}; "
          f"logps/chosen {step1['logps/chosen']:.9f}, by hand {hand['logps/chosen']:.9f}")
    assert step1["loss"] == pytest.approx(math.log(2), rel=rtol)  # the reference is the base
    assert step1["grad_norm"] == pytest.approx(grad_norm, rel=grad_rtol)
    for key in ("logps/chosen", "logps/rejected"):
        assert step1[key] == pytest.approx(hand[key].item(), rel=rtol), key


def test_recipe_eval_only_against_the_base_equals_float64_by_hand(tiny, run):
    _, model_dir, _, valid = tiny
    out, _ = run
    assert cli([str(out), "--eval-only"]) == 0  # OUT/hf, the base as the reference
    records = metric_records(out, "eval")
    found = records[max(records)]
    processor = AutoProcessor.from_pretrained(out / "hf")
    with torch.no_grad():
        hand = dpo_by_hand(load64(out / "hf"), load64(model_dir), processor, valid)
    pairs = read_pairs(valid, PairFields())
    rtol = float32_rtol(load64(model_dir), ImagePairs(pairs, processor, "llava").batch(
        list(range(len(pairs))), 0))
    print(f"--eval-only valid/loss {found['valid/loss']:.9f}, by hand {hand['loss']:.9f}")
    assert abs(hand["loss"].item() - math.log(2)) > 1e-4  # it trained: not the base
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert found[f"valid/{key}"] == pytest.approx(hand[key].item(), rel=rtol), key


def test_bad_pairs_are_one_line_exit_2_nothing_written(tiny, tmp_path, capsys):
    _, model_dir, train, _ = tiny
    good = json.loads(train.read_text().splitlines()[0])
    image = train.parent / good["images"][0]
    cases = {
        "missing": ({**good, "images": ["images/gone.png"]},
                    "field 'images[0]': cannot read image"),
        "unreadable": ({**good, "images": ["bad.png"]}, "field 'images[0]': cannot read image"),
        "url": ({**good, "images": ["https://example.com/a.png"]}, "field 'images[0]' is a URL"),
        "count": ({**good, "images": [good["images"][0]] * 2},
                  "field 'images' holds 2 image(s), 'prompt' and 'chosen' have 1 image part(s)"),
        "text": ({**good, "prompt": "What colour ?"}, "field 'prompt' holds str"),
    }
    for name, (record, message) in cases.items():
        data = tmp_path / name
        (data / "images").mkdir(parents=True)
        (data / good["images"][0]).write_bytes(image.read_bytes())
        (data / "bad.png").write_text("not a png")
        (data / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        out = tmp_path / f"out_{name}"
        code = cli([str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
                    "--set", f"data.files=[{data / 'train.jsonl'}]"])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2, (name, err)
        assert f"error: data file {data / 'train.jsonl'}, line 2: {message}" in err, (name, err)
        assert "Traceback" not in err
        assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}, name
