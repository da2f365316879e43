"""KTO (`python -m recipes.preference --set loss.kind=kto`) on TRL's unpaired format, on the
tiny chat model: the unit's step-1 loss, KL estimate and whole gradient over a step of two
micro-batches equal `kto_hand` (float64, one sequence at a time) with the estimate positive
and clamped; the recipe's published step-2 loss, KL and gradient norm (the policy moved, the
reference the start) equal the hand's; DDP2 and FSDP2 give one process's numbers (the KL partners
and the estimate are the step's, not a device's); mistakes are one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kto_hand import step_by_hand
from recipe_runs import assert_one_line_errors, describe, metric_records, run_all, torchrun
from tolerances import reordered_sum_rtol
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangs import FakeGang, setup_gangs
from gangtrain.models.hf import export_pretrained, load_pretrained
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.posttrain.objectives.preference import PreferenceConfig, prepare_unpaired
from gangtrain.tiny.pairs import make_tiny_chat_model, unpaired_examples, write_unpaired_data
from recipes.preference.recipe import cli
from units.metrics import MetricBag
from units.preference import PreferenceLoss, PreferenceUnit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

B, ACC = 4, 2
STEPS = 10
SETTINGS = {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.33}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, another model of the same tokenizer, 8 examples, train, valid, cache)."""
    base = tmp_path_factory.mktemp("kto")
    return (make_tiny_chat_model(base / "model"), make_tiny_chat_model(base / "other", seed=1),
            write_unpaired_data(base / "eight.jsonl", B * ACC, seed=3),
            write_unpaired_data(base / "train.jsonl", 200),
            write_unpaired_data(base / "valid.jsonl", 12, seed=1), base / "cache")


def config(tiny, files: Path, **trainer) -> PreferenceConfig:
    return PreferenceConfig.model_validate({
        "model": {"path": str(tiny[0])}, "loss": {"kind": "kto", **SETTINGS},
        "data": {"files": [str(files)], "valid_files": [str(tiny[4])], "batch_size": B,
                 "cache_dir": str(tiny[5])},
        "trainer": {"num_accumulate": ACC, **trainer}})


def float64(path: Path) -> torch.nn.Module:
    return load_pretrained(path, setup_gangs(FakeGang()), data_parallel=None,
                           dtype=torch.float64).eval()


def step_examples(tiny, files: Path, step: int) -> list[list[dict]]:
    """The global micro-batches of training step `step` (1-based) as the reader orders them
    (GlobalBatchReader's documented order: randperm seeded shuffle_seed + epoch)."""
    records = [json.loads(line) for line in files.read_text().splitlines()]
    reader = prepare_unpaired(config(tiny, files), AutoTokenizer.from_pretrained(tiny[0])).train
    order = torch.randperm(len(reader.bins), generator=torch.Generator().manual_seed(0)).tolist()
    start = (step - 1) * ACC
    return [[records[int(reader.bins.bin(b)[0])] for b in order[m * B:(m + 1) * B]]
            for m in range(start, start + ACC)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("positive", [True, False], ids=["kl_positive", "kl_clamped"])
def test_unit_step_equals_the_hand_computation(tiny, positive, packed):
    """The real reader and unit, float64, one step of two micro-batches; policy and
    reference two models, so the estimate is not 0: positive one way round, and the other
    way the mean log-ratio of the mismatched rows is negative and the clamp holds it at 0.
    Packed: the models attend per document, as the recipe makes them, so each batch's rows
    run as one packed row (`units.packed_rows`)."""
    first, second = (tiny[1], tiny[0]) if positive else (tiny[0], tiny[1])
    c = config(tiny, tiny[2])
    reader = prepare_unpaired(c, AutoTokenizer.from_pretrained(tiny[0])).train
    policy, reference = float64(first), float64(second)
    if packed:
        assert use_document_attention(policy) and use_document_attention(reference)
    unit = PreferenceUnit(policy, PreferenceLoss("kto", **SETTINGS), reference)
    head_rows = {"policy": 0, "reference": 0}  # the positions each head computed
    for name, model in (("policy", policy), ("reference", reference)):
        model.get_output_embeddings().register_forward_hook(
            lambda _, inputs, __, name=name: head_rows.update(
                {name: head_rows[name] + inputs[0].shape[:-1].numel()}))
    metrics, total, count, answers = MetricBag(), 0.0, 0, 0
    batches = iter(reader)
    for _ in range(ACC):
        batch = next(batches)
        answers += sum(int((rows["labels"][:, 1:] != -100).sum())  # the step's, at its start
                       for b in batch.get("window", []) for rows in (b["completions"], b["kl"]))
        loss, n = unit(batch, metrics)
        loss.backward()
        total, count = total + float(loss), count + n
    # each model scores the completions and the mismatched rows once, its head at their
    # answer tokens only: a prompt costs no head
    assert head_rows == {"policy": answers, "reference": answers}
    ours = {k: p.grad / count for k, p in policy.named_parameters()}
    hand = step_by_hand(float64(first), float64(second),
                        AutoTokenizer.from_pretrained(tiny[0]), step_examples(tiny, tiny[2], 1),
                        **SETTINGS)
    kl = metrics.sync_and_compute(FakeGang())["kl"]
    worst = max(float((ours[k] - g).abs().max() / g.abs().max()) for k, g in hand["grads"].items())
    print(f"{'positive' if positive else 'clamped'}: loss {total / count:.12f} (hand "
          f"{hand['loss']:.12f}), kl {kl:.9f} (hand {hand['kl']:.9f}), gradient gap {worst:.1e}")
    assert (hand["kl"] > 0.0) == positive
    # float64 both ways (LlamaRMSNorm's float32 the same on both sides): a few roundings.
    assert total / count == pytest.approx(hand["loss"], rel=1e-9)
    assert kl == pytest.approx(hand["kl"], rel=1e-9, abs=1e-12)
    assert worst < 1e-9


def args(out: Path, tiny, *extra: str) -> list:
    return [out, "--preset", "tiny", "--set", f"model.path={tiny[0]}",
            "--set", f"data.files=[{tiny[3]}]", "--set", f"data.valid_files=[{tiny[4]}]",
            "--set", f"data.cache_dir={tiny[5]}", "--set", "loss.kind=kto",
            *(x for k, v in SETTINGS.items() for x in ("--set", f"loss.{k}={v}")),
            "--set", f"data.batch_size={B}", "--set", f"trainer.num_accumulate={ACC}",
            "--set", "trainer.publish_metrics_every_n_steps=1",
            "--set", "trainer.validate_every_n_steps=5",
            "--set", "trainer.checkpoint_every_n_steps=5",
            "--set", f"trainer.max_num_steps={STEPS}",
            "--set", "optimizer.lr=1e-2", *extra]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("kto_runs")
    commands = {
        "straight": ["recipes.preference", *args(base / "straight", tiny)],
        "ddp2": torchrun("recipes.preference", *args(base / "ddp2", tiny, "--set",
                                                   "trainer.data_parallel=ddp",
                                                   "--set", "gangs.timeout_s=60")),
        "fsdp2": torchrun("recipes.preference", *args(base / "fsdp2", tiny, "--set",
                                                    "gangs.timeout_s=60")),
        "one_step": ["recipes.preference", *args(base / "one_step", tiny,
                                                 "--set", "trainer.max_num_steps=1",
                                                 "--set", "trainer.checkpoint_every_n_steps=1",
                                                 "--set", "trainer.validate_every_n_steps=1")],
    }
    for name, proc in run_all(commands).items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr, name
    return {name: base / name for name in commands}


def test_recipe_step_two_equals_the_hand_computation(runs, tiny, tmp_path):
    """Step 1: the policy is the reference, so the estimate and every log-ratio are 0 and
    the loss is the mean weight times 1/2. Step 2: the policy after step 1 (exported from
    its checkpoint) against the start, by hand in float64."""
    steps = metric_records(runs["straight"], "train")
    first = step_examples(tiny, tiny[3], 1)
    weights = [SETTINGS["desirable_weight"] if e["label"] else SETTINGS["undesirable_weight"]
               for g in first for e in g]
    assert steps[1]["kl"] == 0.0
    assert steps[1]["loss"] == pytest.approx(0.5 * sum(weights) / len(weights), rel=1e-7)
    moved = export_pretrained(runs["one_step"] / "checkpoints" / "step_1", tmp_path / "step1")
    policy = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float64).eval()
    hand = step_by_hand(policy, float64(tiny[0]), AutoTokenizer.from_pretrained(tiny[0]),
                        step_examples(tiny, tiny[3], 2), **SETTINGS)
    step2 = steps[2]
    print(f"step 2: loss {step2['loss']:.9f} (hand {hand['loss']:.9f}), kl {step2['kl']:.9f} "
          f"(hand {hand['kl']:.9f}), grad_norm {step2['grad_norm']:.9f} "
          f"(hand {hand['grad_norm']:.9f})")
    # Here the estimate is clamped (the moved policy's mismatched rows fell below the
    # reference's); the positive path is the unit test's.
    # float32 against float64 through 2 layers and reductions of <= 320 terms (the
    # vocabulary): a few float32 roundings (6e-8) each; log-probs of ~100 nats make the KL's
    # terms ~1e-5 absolute apart (their difference is ~1: relative 1e-5).
    assert step2["loss"] == pytest.approx(hand["loss"], rel=1e-6)
    assert step2["kl"] == pytest.approx(hand["kl"], rel=1e-5)
    assert step2["grad_norm"] == pytest.approx(hand["grad_norm"], rel=1e-5)


def test_eval_only_scores_the_best_checkpoint_as_its_validation_did(runs):
    out = runs["straight"]
    valid = metric_records(out, "valid")
    best = min(valid.values(), key=lambda r: r["valid/loss"])
    assert cli([str(out), "--eval-only"]) == 0
    last = metric_records(out, "eval")[max(metric_records(out, "eval"))]
    print(f"--eval-only: valid/loss {last['valid/loss']:.9f}, kl {last['valid/kl']:.6f}; the "
          f"run's best (step {best['step']}) {best['valid/loss']:.9f}")
    # The same model, batches and kernels: the same numbers (the per-batch KL included).
    assert last["valid/loss"] == pytest.approx(best["valid/loss"], rel=1e-6)
    assert last["valid/kl"] == pytest.approx(best["valid/kl"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("layout", ["ddp2", "fsdp2"])
def test_data_parallel_equals_one_process(runs, layout):
    reference = metric_records(runs["straight"], "train")
    found = metric_records(runs[layout], "train")
    assert found.keys() == reference.keys()
    # The KL estimate is a difference of ~100-nat log-probabilities: its gap is relative to
    # them, not to itself (cancellation).
    scale = {"loss": lambda r: abs(r["loss"]), "logps/chosen": lambda r: abs(r["logps/chosen"]),
             "kl": lambda r: abs(r["logps/chosen"])}
    gap = max(abs(found[s][k] - reference[s][k]) / max(1.0, scale[k](reference[s]))
              for s in reference for k in scale)
    print(f"{layout}: largest gap to one process over {len(reference)} steps {gap:.1e}")
    # float32 sums of a step's B x ACC examples in another order (the estimate's
    # all-reduce, DDP's gradient average): 2 n u apart a step (tests/tolerances.py),
    # carried into the weights step after step by AdamW: at most the steps' sum.
    assert gap < STEPS * reordered_sum_rtol(B * ACC)


def test_user_mistakes_are_one_clear_line(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    records = unpaired_examples(3)
    records[2]["label"] = "yes"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    cases = {
        "bad_label": (["--set", f"data.files=[{bad}]"],
                      f"data {bad}, line 3: field 'label' holds 'yes'"),
        "pairs": (["--set", f"data.files=[{pairs}]"], "KTO examples need fields"),
        "batch_of_one": (["--set", "data.batch_size=1"], "config 'data.batch_size'"),
        "weight_for_dpo": (["--set", "loss.kind=dpo", "--set", "loss.undesirable_weight=2"],
                           "loss.undesirable_weight applies to kto"),
    }
    assert_one_line_errors(cli, lambda out: args(out, tiny), cases, tmp_path, capsys)
