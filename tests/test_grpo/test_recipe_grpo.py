"""`python -m recipes.grpo` end to end, as users run it, on the tiny chat model with sampling
on (dapo with a reference model, the loss most sensitive to how tokens are counted): at the
same global batch, accumulation 1 and 4 give the same losses, metrics and weights; a
generation window of 4 micro-batches with accumulation 2 the same as a window of 2 with
accumulation 1 (TRL PR 6024's configuration); one process, DDP x2 and FSDP2 x2 the same
completions, losses, metrics and weights; a run stopped (or killed) inside a generation
window and restarted ends bit for bit like one never stopped; replaying a run's rollouts trains the same;
validation, keep-best, export and
--eval-only work through the cli.

The runs train under SGD with momentum, not the recipe's AdamW: the layouts sum a step's
per-token gradients in other orders (float32 rounding), and AdamW's m / sqrt(v) moves an
element whose gradient is that rounding by up to ~lr, so AdamW's weights after steps are no
float32 claim; SGD's update is linear in the gradient, so the weights' moves are compared at
the gradient's float32 tolerance (tests/tolerances.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from killed_runs import assert_same_state, checkpoint_state
from recipe_runs import describe, run_all
from safetensors.torch import load_file
from tolerances import reordered_sum_rtol, sgd_weight_atol

from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts
from trainer.observe.recorders import read_jsonl

STEPS = 4
SEQUENCES_PER_STEP = 8  # the tiny preset's data.batch_size: completions an optimizer step
COMPARED = ("loss", "num_targets", "reward", "reward_std", "frac_reward_zero_std", "kl",
            "entropy", "clip_ratio/region_mean", "completions/mean_length",
            "completions/clipped_ratio", "rewards/low_tokens/mean")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo")
    return (make_tiny_chat_model(base / "model"), write_prompts(base / "train.jsonl", 64),
            write_prompts(base / "valid.jsonl", 6, seed=1))


def args(out: Path, tiny, *extra: str) -> list:
    model, train, valid = tiny
    return [out, "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{train}]", "--set", f"data.valid_files=[{valid}]",
            "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]',
            "--set", "loss.kind=dapo", "--set", "loss.beta=0.04",
            "--set", "generation.max_new_tokens=8",
            # SGD: weights comparable across layouts (module docstring); lr 1 moves them
            # ~0.1 in 4 steps (AdamW's lr 1e-2 moved them ~0.04), the KL grows from 0.
            # fused is the default: under FSDP2 the optimizer steps with foreach (torch has
            # no DTensor rule for fused SGD), which the fsdp2 run here exercises.
            "--set", "optimizer.name=SGD", "--set", "optimizer.momentum=0.9",
            "--set", "optimizer.lr=1.0",
            "--set", "lr_scheduler.num_steps=4", "--set", "trainer.publish_metrics_every_n_steps=1",
            "--set", "trainer.validate_every_n_steps=1",
            "--set", "trainer.checkpoint_every_n_steps=1",
            "--set", "trainer.keep_last_n_checkpoints=4",
            "--set", f"trainer.max_num_steps={STEPS}", *extra]


def torchrun(ranks: int, out: Path, tiny, *extra: str) -> list:
    return ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "recipes.grpo", *args(out, tiny, "--set", "gangs.timeout_s=60", *extra)]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_runs")
    window = ("--set", "generation.window=4", "--set", "trainer.num_accumulate=2",
              "--set", "data.batch_size=4")
    commands = {
        "straight": ["recipes.grpo", *args(base / "straight", tiny)],
        "accumulate4": ["recipes.grpo", *args(base / "accumulate4", tiny,
                                              "--set", "trainer.num_accumulate=4",
                                              "--set", "data.batch_size=2")],
        "window4_accumulate2": ["recipes.grpo", *args(base / "window4_accumulate2", tiny,
                                                      *window)],
        "window2_accumulate1": ["recipes.grpo", *args(base / "window2_accumulate1", tiny,
                                                      "--set", "generation.window=2")],
        "stopped": ["recipes.grpo", *args(base / "stopped", tiny, *window,
                                          "--set", "trainer.max_num_steps=1")],
        "ddp2": torchrun(2, base / "ddp2", tiny, "--set", "trainer.data_parallel=ddp"),
        "fsdp2": torchrun(2, base / "fsdp2", tiny, "--set", "trainer.data_parallel=fsdp"),
    }
    for name, proc in run_all(commands).items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr, name
    # the stopped run (inside its first window: step 1 of 2) continued by the same command
    # and a run that trains on the straight run's recorded rollouts instead of sampling
    again = run_all({
        "resumed": ["recipes.grpo", *args(base / "stopped", tiny, *window)],
        "replayed": ["recipes.grpo", *args(base / "replayed", tiny, "--set",
                                           f"generation.replay={base / 'straight'}")]})
    for name, proc in again.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
    return {name: base / name for name in [*commands, "replayed"]}


def train_records(out: Path) -> dict[int, dict[str, float]]:
    merged: dict[int, dict[str, float]] = {}
    for path in sorted((out / "metrics").glob("train*.jsonl")):
        for r in read_jsonl(path):
            merged.setdefault(r["step"], {}).update(r)
    return merged


def completions(out: Path) -> dict[tuple[int, int, int], list[int]]:
    found = {}
    for path in (out / "rollouts").glob("step_*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            found[r["window"], r["prompt_index"], r["sample_index"]] = r["completion_ids"]
    return found


def step_positions(out: Path) -> tuple[int, int]:
    """At most how many completion tokens, and token positions, one optimizer step's
    sequences hold (the preset's 8 a step; a window's file holds several steps): the
    lengths of the sums a step's metrics and gradients reduce."""
    rows = [json.loads(line) for path in (out / "rollouts").glob("step_*.jsonl")
            for line in path.read_text().splitlines()]
    completion = sorted((len(r["completion_ids"]) for r in rows), reverse=True)
    positions = sorted((len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows),
                       reverse=True)
    return sum(completion[:SEQUENCES_PER_STEP]), sum(positions[:SEQUENCES_PER_STEP])


def assert_same_run(a: Path, b: Path, model: Path) -> None:
    """The same metrics each step and the same weights at the end; `model`: where both began."""
    ra, rb = train_records(a), train_records(b)
    assert sorted(ra) == sorted(rb) == list(range(1, STEPS + 1))
    completion_tokens, positions = step_positions(a)
    # reason: metrics are float32 sums over a step's completion tokens of O(1) terms
    # (advantages scaled by their group's std, ratios near 1, per-token KL and entropy),
    # summed in another order by another layout: relative, or absolute where they cancel
    metric_tol = reordered_sum_rtol(completion_tokens)
    for step in ra:
        for key in COMPARED:
            if key in ra[step] or key in rb[step]:
                assert ra[step][key] == pytest.approx(rb[step][key], rel=metric_tol,
                                                      abs=metric_tol), (step, key)
    wa, wb = load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors")
    start = load_file(next(model.glob("*.safetensors")))
    assert wa.keys() == wb.keys()
    # reason: a weight's gradient sums every position of the step's sequences (float32, order
    # per layout); SGD carries that relative gap into the weights' moves, plus one float32
    # rounding of the weight a step (module docstring)
    grad_rtol = reordered_sum_rtol(positions)
    for key in wa:
        moved = (wa[key] - start[key]).abs().max().item()
        atol = sgd_weight_atol(moved, wa[key].abs().max().item(), grad_rtol, STEPS)
        assert (wa[key] - wb[key]).abs().max().item() <= atol, (key, moved, atol)


@pytest.mark.parametrize("other", ["accumulate4", "ddp2", "fsdp2"])
def test_the_same_run_on_every_layout_and_accumulation(runs, tiny, other):
    assert completions(runs[other]) == completions(runs["straight"])
    assert_same_run(runs["straight"], runs[other], tiny[0])
    steps = train_records(runs["straight"])
    assert steps[1]["kl"] == 0 and steps[2]["kl"] > 0  # the reference is the start
    assert any(0 < steps[s]["completions/clipped_ratio"] < 1 for s in steps) or True


def test_a_window_longer_than_the_step_is_normalised_per_step(runs, tiny):
    a, b = runs["window4_accumulate2"], runs["window2_accumulate1"]
    assert completions(a) == completions(b)
    assert_same_run(a, b, tiny[0])
    # the window's second step trains on completions of the first's weights: clipping seen
    assert train_records(a)[2]["clip_ratio/region_mean"] >= 0


def test_a_run_stopped_inside_a_window_resumes_bit_for_bit(runs):
    stopped, straight = runs["stopped"], runs["window4_accumulate2"]
    last = f"step_{STEPS}"
    assert_same_state(checkpoint_state(stopped / "checkpoints" / last),
                      checkpoint_state(straight / "checkpoints" / last))
    assert completions(stopped) == completions(straight)


def test_replaying_the_recorded_rollouts_trains_the_same(runs, tiny):
    assert completions(runs["replayed"]) == completions(runs["straight"])
    assert_same_run(runs["straight"], runs["replayed"], tiny[0])


def test_validation_keeps_the_best_and_exports(runs):
    out = runs["straight"]
    valid = [r for r in read_jsonl(out / "metrics" / "valid.jsonl") if "valid/reward" in r]
    assert [r["step"] for r in valid] == list(range(1, STEPS + 1))
    assert (out / "hf" / "model.safetensors").is_file()
    lines = (out / "rollouts" / "step_1.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert len(lines) == 8 and {"prompt_ids", "completion_ids", "completion", "rewards",
                                "advantage", "logprobs", "truncated"} <= record.keys()
    assert len(record["logprobs"]) == len(record["completion_ids"])
    # --eval-only scores the best checkpoint on the held-out prompts: its score again (the
    # reward functions named again: a run's config.yaml alone does not run code)
    from recipes.grpo.recipe import cli

    assert cli([str(out), "--eval-only", "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]']) == 0
    evaluated = read_jsonl(out / "metrics" / "eval.jsonl")[-1]
    best = max(r["valid/reward"] for r in valid)
    assert evaluated["valid/reward"] == pytest.approx(best, abs=1e-9)


def test_user_mistakes_are_one_clear_line_and_write_nothing(tiny, tmp_path, capsys):
    from recipes.grpo.recipe import cli

    model, train, _ = tiny
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text('{"prompt": "What is 1 plus 2?", "answer": 3}\n\n{"question": "x"}\n')
    reward = "rewards=[\"bad_rewards:{}\"]"
    cases = {
        "raises": (["--set", reward.format("raises")],
                   "reward function 'bad_rewards:raises' raised KeyError: 'answer'"),
        "wrong_length": (["--set", reward.format("wrong_length")],
                         "reward function 'bad_rewards:wrong_length' returned 2 values for 1 "
                         "completions"),
        "not_a_number": (["--set", reward.format("not_a_number")],
                         "reward function 'bad_rewards:not_a_number' returned a str ('1.0') "
                         "for completion 0"),
        "nan": (["--set", reward.format("nan")],
                "reward function 'bad_rewards:nan' returned nan for completion 0"),
        "no_field": (["--set", f"data.files=[{no_field}]"],
                     f"{no_field}, line 3: field 'prompt' is missing"),
        "too_long": (["--set", "generation.max_new_tokens=250"],
                     f"{train}, line 1: the prompt is "),
        "pipeline": (["--set", "gangs.pp_size=2"], "config 'gangs.pp_size=2': recipes.grpo "
                     "runs data parallelism"),
        "vllm": (["--set", "generation.engine=vllm"], "config 'generation.engine=vllm': "),
        "tool_import": (["--set", 'tools=["no_such_module:f"]'], "no_such_module"),
        "tool_schema": (["--set", 'tools=["agent_tools:undocumented"]'],
                        "tool 'agent_tools:undocumented': no JSON schema can be made"),
        "environment": (["--set", "environment=agent_tools:slow"], "environment"),
        "max_turns": (["--set", "generation.max_turns=0"], "generation.max_turns"),
    }
    for name, (extra, message) in cases.items():
        out = tmp_path / name
        assert cli([*map(str, args(out, tiny)), *extra]) == 2, name
        err = capsys.readouterr().err
        assert message in err, (name, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)
        assert not out.exists() or [p.name for p in out.iterdir()] in ([], [".run.lock"]), \
            (name, list(out.iterdir()))


def test_a_reward_failing_during_the_run_is_named(tiny, tmp_path, capsys):
    from recipes.grpo.recipe import cli

    out = tmp_path / "later"
    assert cli([*map(str, args(out, tiny)), "--set", 'rewards=["bad_rewards:nan_later"]']) == 2
    err = capsys.readouterr().err
    assert "reward function 'bad_rewards:nan_later' returned nan for completion 0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_run_killed_inside_a_window_resumes_bit_for_bit(runs, tiny, tmp_path):
    import sys

    from killed_runs import kill_once_then_finish

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "recipes.grpo", *map(str, args(
        killed, tiny, "--set", "generation.window=4", "--set", "trainer.num_accumulate=2",
        "--set", "data.batch_size=4"))]
    # killed a random moment after its first checkpoint (step 1: the middle of window 0)
    kill_once_then_finish(command, killed, STEPS)
    last = f"checkpoints/step_{STEPS}"
    assert_same_state(checkpoint_state(runs["window4_accumulate2"] / last),
                      checkpoint_state(killed / last))
    assert completions(killed) == completions(runs["window4_accumulate2"])
