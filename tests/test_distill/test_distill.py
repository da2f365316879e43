"""On-policy distillation (`python -m recipes.distill`) on the tiny chat model and a wider
teacher of its tokenizer: the divergence equals TRL's definition written out as Python sums
over the vocabulary; the unit's step (on-policy samples from the real generator, or the
records' own completions) has the loss and whole gradient of a float64 hand computation
over each sequence unpadded; the run's held-out KL to the teacher falls; DDP2 and FSDP2 give
one process's numbers (samples seeded per example); mistakes are one clear line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from recipe_runs import assert_one_line_errors, describe, run_all, torchrun
from tolerances import reordered_sum_rtol
from transformers import AutoTokenizer

from gangs import FakeGang, setup_gangs
from gangtrain.models.hf import load_pretrained
from gangtrain.posttrain.assembly import stop_ids
from gangtrain.posttrain.objectives.distill import DistillConfig, DistillObjective
from gangtrain.rl.generation import HFGenerator
from gangtrain.tiny.pairs import make_tiny_chat_model
from gangtrain.tiny.prompts import write_prompts
from recipes.distill.recipe import cli
from trainer.observe.recorders import read_jsonl
from units.distill import DistillLoss, DistillUnit, generalized_jsd
from units.metrics import MetricBag

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 10


def jsd_by_hand(s: list[float], t: list[float], beta: float, temperature: float) -> float:
    """TRL's generalised JSD of one position, as Python sums over the vocabulary."""
    def probs(z: list[float]) -> list[float]:
        top = max(v / temperature for v in z)
        e = [math.exp(v / temperature - top) for v in z]
        return [x / sum(e) for x in e]

    ps, pt = probs(s), probs(t)

    def kl(p: list[float], q: list[float]) -> float:
        return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)

    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = [(1 - beta) * a + beta * b for a, b in zip(ps, pt, strict=True)]
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_is_trls_definition(beta, temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(5, 11, generator=g, dtype=torch.float64) * 3
                        for _ in range(2))
    ours = generalized_jsd(student, teacher, beta, temperature)
    hand = [jsd_by_hand(s.tolist(), t.tolist(), beta, temperature)
            for s, t in zip(student, teacher, strict=True)]
    # float64 both ways, sums of 11 terms: a few float64 roundings.
    assert ours.tolist() == pytest.approx(hand, rel=1e-12, abs=1e-15)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(student, teacher (wider, same tokenizer), train prompts with completions, valid)."""
    base = tmp_path_factory.mktemp("distill")
    train = write_prompts(base / "train.jsonl", 200)
    records = [json.loads(line) for line in train.read_text().splitlines()]
    for r in records:  # the dataset's own completions, for lmbda < 1
        r["completion"] = [{"role": "assistant", "content": f"It is {r['answer']}."}]
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    return (make_tiny_chat_model(base / "student"),
            make_tiny_chat_model(base / "teacher", hidden_size=96, seed=1), train,
            write_prompts(base / "valid.jsonl", 8, seed=1))


def float64(path: Path) -> torch.nn.Module:
    return load_pretrained(path, setup_gangs(FakeGang()), data_parallel=None,
                           dtype=torch.float64).eval()


def hand_step(student: torch.nn.Module, teacher: torch.nn.Module, prompts, completions,
              loss: DistillLoss) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sequence alone, unpadded: the divergence at the positions predicting its
    completion tokens, summed, backward, divided by the tokens after."""
    student.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([list(prompt) + list(completion)])
        at = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
        s = student(ids).logits[0, at]
        with torch.no_grad():
            t = teacher(ids).logits[0, at]
        per_token = generalized_jsd(s, t, loss.beta, loss.temperature)
        for row_s, row_t, value in zip(s.tolist(), t.tolist(), per_token.tolist(),
                                       strict=True):  # the value by Python sums too
            assert value == pytest.approx(jsd_by_hand(row_s, row_t, loss.beta,
                                                      loss.temperature), rel=1e-9, abs=1e-15)
        per_token.sum().backward()
        total += float(per_token.sum())
        count += len(completion)
    return total / count, {k: p.grad / count for k, p in student.named_parameters()}


@pytest.mark.parametrize("settings", [
    {"beta": 0.0, "temperature": 1.0, "lmbda": 1.0},
    {"beta": 0.5, "temperature": 0.8, "lmbda": 1.0},
    {"beta": 1.0, "temperature": 1.0, "lmbda": 0.0},
], ids=["forward_on_policy", "jsd_on_policy", "reverse_dataset"])
def test_unit_step_equals_the_hand_computation(tiny, settings):
    student_dir, teacher_dir, train, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    config = DistillConfig.model_validate({
        "model": {"path": str(student_dir)}, "teacher": {"path": str(teacher_dir)},
        "data": {"files": [str(train)], "batch_size": 3, "seq_len": 128},
        "generation": {"max_new_tokens": 10}, "loss": settings})
    reader = DistillObjective().read_data(config, tokenizer, 0, 1, True).train
    loss = DistillLoss(**settings)
    student, teacher = float64(student_dir), float64(teacher_dir)
    generator = HFGenerator(student, stop_ids=stop_ids(str(student_dir), tokenizer),
                            pad_id=tokenizer.pad_token_id, max_new_tokens=10)
    unit = DistillUnit(student, teacher, loss, generator, tokenizer.pad_token_id, seed=2)
    head_rows = {"student": 0, "teacher": 0}  # the positions each head computed to train
    for name, model in (("student", student), ("teacher", teacher)):
        model.get_output_embeddings().register_forward_hook(
            lambda _, inputs, __, name=name: head_rows.update(
                {name: head_rows[name] + inputs[0].shape[:-1].numel()})
            if name == "teacher" or torch.is_grad_enabled() else None)  # (not sampling)
    batches, trained = iter(reader), []
    total, count = 0.0, 0
    for index in range(2):  # one step of two micro-batches
        batch = next(batches)
        unit.set_micro_batch(index, 2)
        value, n = unit(batch, MetricBag())
        value.backward()
        total, count = total + float(value), count + int(n)
        trained.append((batch["prompts"], unit.last_completions))
    # both heads ran at the completion tokens only: a prompt costs no head, no softmax
    assert head_rows == {"student": count, "teacher": count}
    if settings["lmbda"] == 0.0:  # the records' own completions, not samples
        assert all(c in reader.data.completions for _, cs in trained for c in cs)
    ours = {k: p.grad / count for k, p in student.named_parameters()}
    hand_loss, hand_grads = hand_step(float64(student_dir), float64(teacher_dir),
                                      [p for ps, _ in trained for p in ps],
                                      [c for _, cs in trained for c in cs], loss)
    worst = max(float((ours[k] - g).abs().max() / g.abs().max()) for k, g in hand_grads.items())
    print(f"{settings}: loss {total / count:.12f} (hand {hand_loss:.12f}), gradient gap "
          f"{worst:.1e}, {count} completion tokens")
    # float64 both ways (LlamaRMSNorm's float32 the same on both sides): a few roundings.
    assert total / count == pytest.approx(hand_loss, rel=1e-9)
    assert worst < 1e-9


def args(out: Path, tiny, *extra: str) -> list:
    student, teacher, train, valid = tiny
    return [out, "--preset", "tiny", "--set", f"model.path={student}",
            "--set", f"teacher.path={teacher}", "--set", f"data.files=[{train}]",
            "--set", f"data.valid_files=[{valid}]", "--set", "trainer.validate_at_start=true",
            "--set", f"trainer.max_num_steps={STEPS}",
            "--set", "trainer.publish_metrics_every_n_steps=1", *extra]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("distill_runs")
    commands = {
        "straight": ["recipes.distill", *args(base / "straight", tiny)],
        "ddp2": torchrun("recipes.distill", *args(base / "ddp2", tiny, "--set",
                                                "trainer.data_parallel=ddp",
                                                "--set", "gangs.timeout_s=60")),
        "fsdp2": torchrun("recipes.distill", *args(base / "fsdp2", tiny, "--set",
                                                 "gangs.timeout_s=60")),
    }
    for name, proc in run_all(commands).items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr, name
    return {name: base / name for name in commands}


def valid_records(out: Path, name: str = "valid") -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in read_jsonl(out / "metrics" / f"{name}.jsonl")}


def test_held_out_kl_to_the_teacher_falls_and_eval_only_reads_it(runs):
    valid = valid_records(runs["straight"])
    kls = [valid[s]["valid/kl"] for s in sorted(valid)]
    print(f"valid/kl over the run: {', '.join(f'{k:.4f}' for k in kls)}")
    assert kls[-1] < 0.5 * kls[0]
    assert cli([str(runs["straight"]), "--eval-only"]) == 0
    last = valid_records(runs["straight"], "eval")
    assert last[max(last)]["valid/kl"] == pytest.approx(kls[-1], rel=1e-6)


@pytest.mark.parametrize("layout", ["ddp2", "fsdp2"])
def test_data_parallel_equals_one_process(runs, layout):
    for section, keys in (("train", ("loss",)), ("valid", ("valid/kl", "valid/loss"))):
        reference = valid_records(runs["straight"], section)
        found = valid_records(runs[layout], section)
        assert found.keys() == reference.keys()
        assert section == "valid" or sorted(reference) == list(range(1, STEPS + 1))
        gap = max(abs(found[s][k] - reference[s][k]) / abs(reference[s][k])
                  for s in reference for k in keys)
        print(f"{layout} {section}: largest gap to one process over {STEPS} steps {gap:.1e}")
        # The same samples (seeded per example); float32 sums of a step's completion tokens
        # (<= 4 x 12) in another order: 2 n u apart a step (tests/tolerances.py), carried
        # into the weights step after step by AdamW: at most the steps' sum.
        assert gap < STEPS * reordered_sum_rtol(4 * 12), section


def test_user_mistakes_are_one_clear_line(tiny, tmp_path, capsys):
    other = make_tiny_chat_model(tmp_path / "other_vocab", vocab_size=300)
    no_completions = write_prompts(tmp_path / "prompts.jsonl", 20)
    cases = {
        "vocabulary": (["--set", f"teacher.path={other}"], "config 'teacher.path': "),
        "lmbda": (["--set", f"data.files=[{no_completions}]", "--set", "loss.lmbda=0.5"],
                  "config 'loss.lmbda=0.5' trains a share on the records' own 'completion'"),
        "beta": (["--set", "loss.beta=2"], "beta"),
    }
    assert_one_line_errors(cli, lambda out: args(out, tiny), cases, tmp_path, capsys)
