"""The LM recipe's schedule has its own length: extending a run (resuming with a larger
max_num_steps) leaves the learning rates of the steps already taken as they were, so the
extended run ends bit for bit as a straight run with the same schedule."""

from __future__ import annotations

import math

import torch
from recipe_runs import describe, run_all, run_module

from trainer.checkpoint import read_model_state
from trainer.lr_schedules import WarmupCosine
from trainer.observe.recorders import read_jsonl


def test_schedule_follows_warmup_then_cosine_to_its_own_length():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    schedule = WarmupCosine(optimizer, warmup_steps=4, num_steps=24, final_lr_scale=0.1)
    rates = []
    for _ in range(30):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    for step, rate in enumerate(rates):  # a hand-written reference
        if step < 4:
            expected = 2.0 * (step + 1) / 4
        else:
            progress = min(1.0, (step - 4) / 20)
            expected = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert math.isclose(rate, expected, rel_tol=1e-12), step


def test_extending_a_run_keeps_its_past_rates_and_equals_a_straight_run(tmp_path):
    extended, straight = tmp_path / "extended", tmp_path / "straight"
    tiny = ["--preset", "tiny", "--set", "lr_scheduler.warmup_steps=3"]
    runs = run_all({
        # The first run: 20 steps, its schedule 20 steps long (the default length) ...
        "first": ["recipes.lm", extended, *tiny, "--set", "trainer.max_num_steps=20"],
        # ... and the reference: 40 steps straight on a schedule of 20.
        "straight": ["recipes.lm", straight, *tiny, "--set", "trainer.max_num_steps=40",
                     "--set", "lr_scheduler.num_steps=20"],
    })
    for proc in runs.values():
        assert proc.returncode == 0, describe(proc)
    first_lrs = {r["step"]: r["lr"] for r in read_jsonl(extended / "metrics" / "train.jsonl")}
    rank_state = torch.load(extended / "checkpoints" / "step_20" / "rank_0.pt",
                            weights_only=True)
    assert rank_state["lr_scheduler"]["num_steps"] == 20  # recorded in the checkpoint

    # Extended to 40 steps: the schedule keeps the length it started with.
    second = run_module("recipes.lm", extended, *tiny, "--set", "trainer.max_num_steps=40")
    assert second.returncode == 0, describe(second)
    got = read_jsonl(extended / "metrics" / "train.jsonl")
    expected = read_jsonl(straight / "metrics" / "train.jsonl")
    assert [r["step"] for r in got] == [10, 20, 30, 40]
    assert {r["step"]: r["lr"] for r in got if r["step"] <= 20} == first_lrs  # the past
    assert got[2]["lr"] == 3e-3 * 0.1  # step 30: past the end of the 20-step schedule
    assert [(r["step"], r["lr"], r["loss"]) for r in got] == \
        [(r["step"], r["lr"], r["loss"]) for r in expected]
    assert got[-1]["lr"] == 3e-3 * 0.1  # past its end the rate stays at lr * final scale
    a, b = (read_model_state(d / "checkpoints" / "step_40") for d in (extended, straight))
    for name, value in b.items():
        assert torch.equal(a[name], value), name
