"""Multi-turn GRPO with tools under layouts and resume (issue 70, item 7), through
`python -m recipes.grpo` as users run it: one process, DDP x2 and FSDP2 x2 sample the same
trajectories (token ids, sampled masks, messages) and each tool call runs once, on one rank;
their losses, metrics and weights agree within the float32 tolerances of tests/tolerances.py;
a run killed inside a generation window (after the window's tool calls ran) and restarted
with the same command ends bit for bit like a run never killed, without running the
checkpointed window's tools again. Under FSDP2 every forward is a collective: the ranks
agree on a round's prefill forwards before running them (a tool result continues a row on
one rank only), which this test found deadlocking when it came after them.

The policy is a warm tiny model that really calls the tool: its tokenizer holds the whole
call `<tool_call>{"name": "count", ...}</tool_call>` as one added token, its layers' output
projections start at zero (the residual stream is the token's embedding) and its embedding
and head are set so that the call token has probability ~0.3 at every position and
`<|im_end|>` ~0.99 right after it: a turn is a few sampled tokens, then (mostly) the call;
the tool's result comes back as a `tool` turn of context tokens (mask 0); the second turn
is the last (generation.max_turns=2). A random tiny model almost never writes a parsable
call.

The tool (`count`) is a module written in tmp_path, one per run, that appends a line (its
rank and process id) to the run's own file each time it runs: how many times the tools ran,
where and in which process.

SGD, not AdamW: weights across layouts are a float32 claim only under an update linear in
the gradient (tests/tolerances.py; test_recipe_grpo's docstring)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import warm_launch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly
from recipe_runs import REPO, TIMEOUT_S, describe, recipe_env
from safetensors.torch import load_file
from test_recipe_grpo import COMPARED, STEPS, step_positions, train_records
from tolerances import reordered_sum_rtol, sgd_weight_atol

from gangtrain.tiny.chat import make_tiny_chat_model
from gangtrain.tiny.prompts import write_prompts
from gangtrain.tiny.tools import write_tool_template

CALL = '<tool_call>\n{"name": "count", "arguments": {"n": 7}}\n</tool_call>'
WINDOW_STEPS = 2  # generation.window 4 micro-batches, accumulation 2: a window is 2 steps

TOOL_MODULE = '''import os


def count(n: int) -> int:
    """Counts its calls in a file.

    Args:
        n: A number.
    """
    with open({log!r}, "a") as f:
        f.write(f"{{os.environ.get('RANK', '0')}} {{os.getpid()}}\\n")
    return n + 1
'''


def make_calling_model(directory: Path) -> Path:
    """The tiny chat model (context 1024: room for the tool's schema) made to call `count`
    (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_tiny_chat_model(directory, max_positions=1024)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([CALL])
    tokenizer.save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    call, end = (tokenizer.convert_tokens_to_ids(t) for t in (CALL, "<|im_end|>"))
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        torch.manual_seed(0)
        emb[call] = 0.02 * torch.randn(emb.shape[1])
        emb[:, 0], emb[:, 1] = 4.0, 0.0  # dim 0 on every token: after the norm ~8
        emb[call, 1] = 8.0  # dim 1 only on the call token
        head[:, :2] = 0.0
        head[call, 0], head[call, 1] = 5.0 / 8, -2.0  # logit ~5 (p ~0.3), never twice
        head[end, 1] = 10.0 / 7  # after the call: <|im_end|>, logit ~10
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent_layouts")
    return (base, make_calling_model(base / "model"), write_prompts(base / "train.jsonl", 64),
            write_tool_template(base / "tools.jinja"))


def args(out: Path, tiny, tool_module: str, *extra: str) -> list[str]:
    _, model, train, template = tiny
    return [str(a) for a in (
        out, "--preset", "tiny", "--set", f"model.path={model}",
        "--set", f"data.files=[{train}]", "--set", f"data.chat_template={template}",
        "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]',
        "--set", f'tools=["{tool_module}:count"]', "--set", "generation.max_turns=2",
        "--set", "generation.max_new_tokens=12", "--set", "generation.num_generations=4",
        "--set", "generation.window=4", "--set", "trainer.num_accumulate=2",
        "--set", "data.batch_size=4",
        "--set", "loss.kind=dapo", "--set", "loss.beta=0.04",
        "--set", "optimizer.name=SGD", "--set", "optimizer.momentum=0.9",
        "--set", "optimizer.lr=0.1", "--set", f"lr_scheduler.num_steps={STEPS}",
        "--set", "trainer.publish_metrics_every_n_steps=1",
        "--set", "trainer.checkpoint_every_n_steps=1",
        "--set", "trainer.validate_every_n_steps=1",  # no held-out prompts: no validation
        "--set", f"trainer.keep_last_n_checkpoints={STEPS}",
        "--set", f"trainer.max_num_steps={STEPS}", *extra)]


def tool_env(base: Path, name: str) -> tuple[str, Path, dict[str, str]]:
    """A tool module `calls_<name>` counting into base/calls_<name>.log, and the environment
    that imports it (its folder on PYTHONPATH, for every rank)."""
    folder = base / "tools"
    folder.mkdir(exist_ok=True)
    log = folder / f"calls_{name}.log"
    log.write_text("")
    (folder / f"calls_{name}.py").write_text(TOOL_MODULE.format(log=str(log)))
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return f"calls_{name}", log, env


def command(ranks: int, *rest: str) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "recipes.grpo", *rest]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "recipes.grpo", *rest]


def calls(log: Path) -> list[tuple[str, str]]:
    """(rank, pid) of each time the tool ran."""
    return [tuple(line.split()) for line in log.read_text().splitlines()]


LAYOUTS = {"single": (1, ()), "ddp2": (2, ("--set", "trainer.data_parallel=ddp", "--set", "gangs.timeout_s=60")),
           # a short collective timeout: a lockstep mistake fails in seconds, not minutes
           "fsdp2": (2, ("--set", "trainer.data_parallel=fsdp", "--set", "gangs.timeout_s=20"))}

@pytest.fixture(scope="module")
def runs(tiny):
    base = tiny[0]
    jobs = {}
    for name, (ranks, extra) in LAYOUTS.items():
        module, log, env = tool_env(base, name)
        jobs[name] = (command(ranks, *args(base / name, tiny, module, *extra)), log, env)
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(warm_launch.run, cmd, timeout=TIMEOUT_S, cwd=REPO, env=env)
                   for name, (cmd, _, env) in jobs.items()}
        procs = {name: future.result() for name, future in futures.items()}
    return {name: (base / name, log, procs[name]) for name, (_, log, _) in jobs.items()}


def finished(runs, name: str) -> tuple[Path, Path]:
    """The run's directory and tool-call file, once it is known to have ended well."""
    out, log, proc = runs[name]
    assert proc.returncode == 0, f"{name}: {describe(proc)}"
    assert "Traceback" not in proc.stderr, name
    return out, log


def records(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((out / "rollouts").glob("step_*.jsonl"))
            for line in path.read_text().splitlines()]


def trajectories(out: Path) -> dict[tuple[int, int, int], tuple]:
    return {(r["window"], r["prompt_index"], r["sample_index"]):
            (r["completion_ids"], r["completion_mask"], r["messages"], r["tool_calls"])
            for r in records(out)}


def assert_same_run(a: Path, b: Path, model: Path) -> None:
    """The same metrics each step and the same weights at the last checkpoint (as
    test_recipe_grpo.assert_same_run, on the checkpoints: these runs export no best model)."""
    ra, rb = train_records(a), train_records(b)
    assert sorted(ra) == sorted(rb) == list(range(1, STEPS + 1))
    completion_tokens, positions = step_positions(a)
    # reason: metrics are float32 sums over a step's completion tokens of O(1) terms, summed
    # in another order by another layout: relative, or absolute where they cancel
    metric_tol = reordered_sum_rtol(completion_tokens)
    for step in ra:
        for key in COMPARED:
            if key in ra[step] or key in rb[step]:
                assert ra[step][key] == pytest.approx(rb[step][key], rel=metric_tol,
                                                      abs=metric_tol), (step, key)
    last = f"checkpoints/step_{STEPS}"
    wa, wb = checkpoint_state(a / last), checkpoint_state(b / last)
    start = load_file(next(model.glob("*.safetensors")))
    weights = [k for k in wa if k.startswith("/model/")]
    assert weights and {k.removeprefix("/model/") for k in weights} == start.keys()
    # reason: a weight's gradient sums every position of the step's sequences (float32, order
    # per layout); SGD carries that relative gap into the weights' moves, plus one float32
    # rounding of the weight a step (tests/tolerances.py)
    grad_rtol = reordered_sum_rtol(positions)
    for key in weights:
        begin = start[key.removeprefix("/model/")]
        moved = (wa[key] - begin).abs().max().item()
        atol = sgd_weight_atol(moved, wa[key].abs().max().item(), grad_rtol, STEPS)
        assert (wa[key] - wb[key]).abs().max().item() <= atol, (key, moved, atol)


def test_the_policy_really_calls_the_tool(runs):
    """The runs below compare real multi-turn trajectories: calls run, results in context."""
    out, log = finished(runs, "single")
    rows = records(out)
    assert len(rows) == STEPS * 8
    with_calls = [r for r in rows if r["tool_calls"] > 0]
    assert with_calls
    for r in with_calls:
        assert 0 in r["completion_mask"] and 1 in r["completion_mask"]
        assert any(m["role"] == "tool" and m["content"] == "8" for m in r["messages"])
    # every call that ran is in a record, and ran once
    assert len(calls(log)) == sum(r["tool_calls"] for r in rows)


@pytest.mark.parametrize("other", [
    "ddp2", "fsdp2"])
def test_the_same_trajectories_and_tool_runs_on_every_layout(runs, tiny, other):
    (single, single_log), (out, log) = finished(runs, "single"), finished(runs, other)
    assert trajectories(out) == trajectories(single)
    # each trajectory's tools ran once in all, on one rank: as many runs as on one process
    ran = calls(log)
    assert len(ran) == len(calls(single_log)) == sum(r["tool_calls"] for r in records(out))
    # both ranks own trajectories that call (every one of them does here), one process each
    assert len({rank for rank, _ in ran}) == len({pid for _, pid in ran}) == 2
    # losses and metrics within reordered float32 sums over a step's tokens, weights within
    # SGD's linear carry of the gradient's float32 gap (test_recipe_grpo.assert_same_run)
    assert_same_run(single, out, tiny[1])


def test_a_run_killed_inside_a_window_resumes_bit_for_bit_without_rerunning_tools(runs, tiny):
    base = tiny[0]
    module, log, env = tool_env(base, "killed")
    killed = base / "killed"
    cmd = command(1, *args(killed, tiny, module))
    # SIGKILLed a random moment (0-0.1 s) after its first checkpoint: step 1, inside window 0
    hits = kill_repeatedly(cmd, killed / "checkpoints", 1, random.Random(0), final_step=STEPS,
                           cwd=REPO, env=env)
    assert hits == 1
    before = len(calls(log))
    proc = warm_launch.run(cmd, cwd=REPO, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    resumed = re.search(r"resumed from .* \(step (\d+)\)", proc.stderr)
    assert resumed, proc.stderr
    step = int(resumed.group(1))
    assert step % WINDOW_STEPS == 1, f"resumed at step {step}: not inside a window"

    straight, straight_log = finished(runs, "single")
    last = f"checkpoints/step_{STEPS}"
    assert_same_state(checkpoint_state(straight / last), checkpoint_state(killed / last))
    assert trajectories(killed) == trajectories(straight)
    # the resumed process ran the tools of the windows after the checkpointed one only
    ran = calls(log)
    pids = {pid for _, pid in ran[before:]}
    assert len(pids) <= 1
    resumed_window = step // WINDOW_STEPS
    rows = records(straight)
    # the killed process had run the checkpointed window's calls (and no later window's) ...
    assert before == sum(r["tool_calls"] for r in rows if r["window"] == resumed_window) > 0
    # ... and the resumed one ran only the later windows' calls
    assert len(ran) - before == sum(r["tool_calls"] for r in rows if r["window"] > resumed_window)
    # in all, as many runs as the uninterrupted run's: no call ran twice
    assert len(ran) == len(calls(straight_log))
