"""`python -m recipes.reward` end to end, as users run it, on the tiny chat model: the step-1
loss and gradient norm the Trainer publishes equal `reward_hand` (float64, one pair at a
time, with margins and centring); the unit's whole step-1 gradient equals it elementwise;
DDP2 and FSDP2 give one process's numbers; the exported OUT/hf loads as a sequence-classification
model that ranks the held-out pairs exactly as often as the published valid accuracy says,
and `--eval-only` on it gives the run's valid metrics; LoRA trains the score head beside
the adapters; mistakes are one clear line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from recipe_runs import assert_one_line_errors, describe, metric_records, run_all, torchrun
from reward_hand import ranked_right, step_by_hand
from tolerances import FLOAT32_UNIT, reordered_sum_rtol
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from gangs import FakeGang, setup_gangs
from gangtrain.models.hf import load_pretrained
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.posttrain.objectives.preference import prepare_pairs
from gangtrain.posttrain.objectives.reward import RewardConfig
from gangtrain.rl.rewards import ModelReward
from gangtrain.tiny.pairs import make_tiny_chat_model, preference_pairs, write_pair_data
from recipes.reward.recipe import cli
from units.metrics import MetricBag
from units.reward import RewardLoss, RewardUnit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NUM_VALID = 24
STEPS = 10
COEFFICIENT = 0.01
MARGINS = (0.0, 0.5, -0.25, 1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, 4 train pairs with margins, train pairs, valid pairs, cache)."""
    base = tmp_path_factory.mktemp("reward")
    four = base / "four.jsonl"
    four.write_text("".join(json.dumps({**p, "margin": m}) + "\n"
                            for p, m in zip(preference_pairs(4, seed=5), MARGINS,
                                            strict=True)))
    return (make_tiny_chat_model(base / "model"), four,
            write_pair_data(base / "train.jsonl", 200),
            write_pair_data(base / "valid.jsonl", NUM_VALID, seed=1), base / "cache")


def args(out: Path, tiny, *extra: str, train: Path | None = None) -> list:
    model, _, pairs, valid, cache = tiny
    return [out, "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{train or pairs}]", "--set", f"data.valid_files=[{valid}]",
            "--set", f"data.cache_dir={cache}", "--set", f"trainer.max_num_steps={STEPS}",
            "--set", "trainer.validate_every_n_steps=5",
            "--set", "trainer.checkpoint_every_n_steps=5",
            "--set", "trainer.publish_metrics_every_n_steps=1",
            "--set", "optimizer.lr=2e-5", *extra]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("reward_runs")
    hand = ("--set", f"loss.center_rewards_coefficient={COEFFICIENT}",
            "--set", "trainer.max_num_steps=1")
    commands = {
        "straight": ["recipes.reward", *args(base / "straight", tiny)],
        "ddp2": torchrun("recipes.reward", *args(base / "ddp2", tiny, "--set",
                                               "trainer.data_parallel=ddp",
                                               "--set", "gangs.timeout_s=60")),
        "fsdp2": torchrun("recipes.reward", *args(base / "fsdp2", tiny, "--set",
                                                "gangs.timeout_s=60")),
        "hand": ["recipes.reward", *args(base / "hand", tiny, *hand, train=tiny[1])],
        "accumulate4": ["recipes.reward", *args(
            base / "accumulate4", tiny, *hand, "--set", "data.batch_size=1",
            "--set", "trainer.num_accumulate=4", train=tiny[1])],
        "lora": ["recipes.reward", *args(base / "lora", tiny, "--set", "lora.r=4",
                                         "--set", "optimizer.lr=1e-2")],
    }
    for name, proc in run_all(commands).items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr, name
    return {name: base / name for name in commands}


def initial_model(model_dir: Path) -> torch.nn.Module:
    """The run's starting model (the backbone from the files, the score head from the run's
    seed, 2 by default), in float64."""
    model = load_pretrained(model_dir, setup_gangs(FakeGang()), data_parallel=None, seed=2,
                            head="sequence_classification",
                            head_config={"num_labels": 1, "pad_token_id": 0})
    return model.double().eval()


def test_step_one_loss_and_gradient_norm_equal_the_hand_computation(runs, tiny):
    model_dir, four = tiny[0], tiny[1]
    pairs = [json.loads(line) for line in four.read_text().splitlines()]
    hand = step_by_hand(initial_model(model_dir), AutoTokenizer.from_pretrained(model_dir),
                        pairs, COEFFICIENT)
    for name in ("hand", "accumulate4"):
        step1 = metric_records(runs[name], "train")[1]
        print(f"{name}: loss {step1['loss']:.9f} (hand {hand['loss']:.9f}), grad_norm "
              f"{step1['grad_norm']:.9f} (hand {hand['grad_norm']:.9f}), accuracy "
              f"{step1['accuracy']} (hand {hand['accuracy']})")
        # float32 forward and backward against float64: a few roundings of ~1e-7 each
        # through 2 layers and reductions of <= 128 terms (as test_family_gradients: 5e-6
        # for the gradient's elements, far less for its norm and the loss).
        assert step1["loss"] == pytest.approx(hand["loss"], rel=1e-6)
        assert step1["grad_norm"] == pytest.approx(hand["grad_norm"], rel=1e-6)
        assert step1["accuracy"] == hand["accuracy"]
        for key in ("rewards/chosen", "rewards/rejected"):
            assert step1[key] == pytest.approx(hand[key], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_units_whole_step_one_gradient_equals_the_hand_computation(tiny, packed):
    """The real reader and unit in float64 (the Trainer's division: the micro-batches'
    summed losses backward, the gradient divided by the pairs after): every element.
    Packed: the model attends per document, as the recipe makes it, so each batch's rows
    run as one packed row, the score read at each row's last token."""
    model_dir, four = tiny[0], tiny[1]
    config = RewardConfig.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"files": [str(four)], "valid_files": [str(tiny[3])], "batch_size": 2,
                 "cache_dir": str(tiny[4])}})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reader = prepare_pairs(config, tokenizer).train
    model = initial_model(model_dir)
    if packed:
        assert use_document_attention(model)
    unit = RewardUnit(model, RewardLoss(center_rewards_coefficient=COEFFICIENT))
    metrics, count = MetricBag(), 0
    batches = iter(reader)
    for _ in range(2):  # two micro-batches of 2: one epoch of the 4 pairs
        loss, n = unit(next(batches), metrics)
        loss.backward()
        count += n
    ours = {k: p.grad / count for k, p in model.named_parameters()}
    pairs = [json.loads(line) for line in four.read_text().splitlines()]
    hand = step_by_hand(initial_model(model_dir), tokenizer, pairs, COEFFICIENT)
    worst = max(float((ours[k] - g).abs().max() / g.abs().max()) for k, g in hand["grads"].items())
    print(f"unit gradient against the hand's, largest gap relative to each tensor: {worst:.1e}")
    # float64 both ways; LlamaRMSNorm rounds through float32 whatever the model's dtype
    # (the same on both sides): a few float64 roundings.
    assert worst < 1e-9
    assert set(ours) == set(hand["grads"])


@pytest.mark.parametrize("layout", ["ddp2", "fsdp2"])
def test_data_parallel_equals_one_process(runs, layout):
    for section, prefix, keys in (("train", "", ("loss", "accuracy", "margin")),
                                  ("valid", "valid/", ("loss", "accuracy", "margin"))):
        reference = metric_records(runs["straight"], section)
        found = metric_records(runs[layout], section)
        assert found.keys() == reference.keys()
        gap = max(abs(found[s][prefix + k] - reference[s][prefix + k])
                  / max(1.0, abs(reference[s][prefix + k])) for s in reference for k in keys)
        print(f"{layout} {section}: largest gap to one process over {STEPS} steps {gap:.1e}")
        # Sums of <= 16 float32 terms (a micro-batch's pairs, split over 2 ranks) in another
        # order: 2 n u apart a step (tests/tolerances.py), carried into the weights step
        # after step (AdamW's lr / sqrt(v) moves, of either sign): at most the steps' sum.
        assert gap < STEPS * reordered_sum_rtol(16), section


def test_exported_model_ranks_as_the_published_valid_accuracy(runs, tiny):
    out, valid = runs["straight"], tiny[3]
    best = max(metric_records(out, "valid").values(), key=lambda r: (r["valid/accuracy"], -r["step"]))
    model = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    pairs = [json.loads(line) for line in valid.read_text().splitlines()]
    right = ranked_right(model, AutoTokenizer.from_pretrained(out / "hf"), pairs)
    print(f"OUT/hf ranks {right}/{NUM_VALID} held-out pairs right; the run published "
          f"valid/accuracy {best['valid/accuracy']} at step {best['step']}")
    assert 0 < best["valid/accuracy"] < 1 or right in (0, NUM_VALID)
    assert right == round(best["valid/accuracy"] * NUM_VALID)
    assert abs(right / NUM_VALID - best["valid/accuracy"]) < FLOAT32_UNIT
    # recipes.grpo's reward source for a model directory (`rewards=[{model: OUT/hf}]`)
    # loads it and ranks the pairs the same, through its own rendering of the text.
    source = ModelReward.load(out / "hf")
    prompts = [p["prompt"] for p in pairs]
    chosen, rejected = (source.compute(prompts, [p[side] for p in pairs], [], {}, step_nr=0,
                                       publish=lambda *_: None)
                        for side in ("chosen", "rejected"))
    assert sum(c > r for c, r in zip(chosen, rejected, strict=True)) == right
    # --eval-only on the exported model directory: the run's best valid metrics.
    assert cli([str(out), "--eval-only"]) == 0
    last = metric_records(out, "eval")[max(metric_records(out, "eval"))]
    assert last["valid/accuracy"] == best["valid/accuracy"]
    assert last["valid/loss"] == pytest.approx(best["valid/loss"], rel=1e-6)


def test_lora_trains_the_score_head_and_exports_a_scoring_model(runs, tiny):
    out = runs["lora"]
    valid = metric_records(out, "valid")
    assert valid[STEPS]["valid/loss"] < valid[5]["valid/loss"] < math.log(2) + 0.1
    model = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    start = initial_model(tiny[0])
    assert not torch.allclose(model.score.weight.double(), start.score.weight)  # it trained
    best = max(valid.values(), key=lambda r: (r["valid/accuracy"], -r["step"]))
    pairs = [json.loads(line) for line in tiny[3].read_text().splitlines()]
    right = ranked_right(model, AutoTokenizer.from_pretrained(out / "hf"), pairs)
    assert right == round(best["valid/accuracy"] * NUM_VALID)


def test_user_mistakes_are_one_clear_line(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    margins = (1.0, 0.5, "big")
    bad.write_text("".join(json.dumps({**p, "margin": m}) + "\n"
                           for p, m in zip(preference_pairs(3), margins, strict=True)))
    cases = {
        "bad_margin": (["--set", f"data.files=[{bad}]"],
                       f"data {bad}, line 3: field 'margin' holds str"),
        "tensor_parallel": (["--set", "gangs.tp_size=2"], "config 'gangs.tp_size=2': "
                            "recipes.reward runs data parallelism only"),
        "coefficient": (["--set", "loss.center_rewards_coefficient=-1"],
                        "center_rewards_coefficient"),
    }
    assert_one_line_errors(cli, lambda out: args(out, tiny), cases, tmp_path, capsys)
