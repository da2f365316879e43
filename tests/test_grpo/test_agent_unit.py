"""Multi-turn rollouts inside `GRPOUnit`, through the Trainer: the trajectories come from the
agent loop (a scripted policy calling the `multiply` tool, run by the real engine), the
rewards see the whole conversation as messages (TRL's signature), the rollout records carry
the ids after the prompt, the sampled mask, the generator's log-probs, the turns as messages
and the tool counts; TRL's tool metrics are published; and replaying the records trains the
same loss, bit for bit."""

from __future__ import annotations

import json

import torch
from scripted_policy import ScriptedLM, calculator_reply
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.agents import AgentLoop
from gangtrain.rl.engine import Engine
from gangtrain.rl.rewards import RewardFunction
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.tools import tool_of
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.chat import make_tiny_chat_model
from gangtrain.tiny.prompts import prompt_records
from gangtrain.tiny.tools import TOOL_TEMPLATE, multiply
from trainer import Trainer
from trainer.observe.recorders import read_jsonl
from trainer.run_dir import RunDir
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts

SEEN: list[list[dict]] = []


def used_the_tool_and_answered(completions, answer, **_):
    """1 when the conversation called multiply and its last message is 'It is <answer>.'."""
    SEEN.extend(completions)
    return [float(any(m.get("tool_calls") for m in c) and c[-1]["content"] == f"It is {a}.")
            for c, a in zip(completions, answer, strict=True)]


def run(tmp_path, out, rollouts_of):
    model_dir = make_tiny_chat_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n"
                            for r in prompt_records(4, words=("times",))))
    prompts = read_prompts([path], tokenizer, max_prompt_tokens=400)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    reward = RewardFunction("tool_answer", "test:tool_answer", used_the_tool_and_answered)
    unit = GRPOUnit(policy, GRPOLoss(kind="dapo", max_new_tokens=120), prompts, [reward],
                    rollouts_of(tokenizer, RunDir(out).rollout_file),
                    num_generations=2, batch_size=4, window=1, pad_id=0)
    Trainer(unit, PromptWindows(4, 2, 1, shuffle=False), torch.optim.SGD(policy.parameters(),
                                                                          lr=0.1),
            output_dir=out, max_num_steps=2, publish_metrics_every_n_steps=1, dtype="fp32",
            progress=False, seed=0).run()
    return {r["step"]: r for r in read_jsonl(out / "metrics" / "train.jsonl")}


def test_multi_turn_rollouts_train_record_and_replay(tmp_path):
    def agent(tokenizer, file_of):
        engine = Engine(ScriptedLM(tokenizer, calculator_reply, answer_logit=8.0),
                        stop_ids=[tokenizer.eos_token_id], pad_id=0, max_batch=2,
                        sync_every=2)
        loop = AgentLoop(engine, tokenizer, tools=[tool_of(multiply)], max_turns=3,
                         max_new_tokens=120, capacity=1024)
        return Rollouts(agent=loop, file_of=file_of, decode=tokenizer.decode)

    logged = run(tmp_path, tmp_path / "run", agent)
    assert SEEN and all(c[1]["role"] == "tool" for c in SEEN)
    assert 0 < logged[1]["reward"] < 1 and logged[1]["tools/call_frequency"] == 1
    assert logged[1]["tools/failure_frequency"] == 0 and logged[1]["turns/mean"] == 2
    assert logged[1]["completions/mean_length"] < logged[1]["completions/mean_context_tokens"]
    records = [json.loads(line) for line in
               (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    for r in records:
        assert len(r["completion_ids"]) == len(r["completion_mask"]) == len(r["logprobs"])
        assert 0 < sum(r["completion_mask"]) < len(r["completion_mask"])
        assert [m["role"] for m in r["messages"]] == ["assistant", "tool", "assistant"]
        assert r["tool_calls"] == 1
    # dapo's targets are the sampled tokens of the step's trajectories
    assert logged[1]["num_targets"] == sum(sum(r["completion_mask"]) for r in records)

    replayed = run(tmp_path, tmp_path / "replayed",
                   lambda tokenizer, file_of: Rollouts(replay=read_replay(tmp_path / "run")))
    assert logged[1]["loss"] != 0  # rewards differ within a group: a real gradient
    assert [replayed[s]["loss"] for s in (1, 2)] == [logged[s]["loss"] for s in (1, 2)]


def test_the_recipe_runs_with_tools_and_an_environment(tmp_path):
    """`recipes.grpo` with tools= and environment=: the rollouts are multi-turn records (the
    random tiny model seldom writes a parsable call; its turns still go through the loop)."""
    from gangtrain.tiny.prompts import write_prompts
    from gangtrain.tiny.tools import write_tool_template
    from recipes.grpo.recipe import cli

    model = make_tiny_chat_model(tmp_path / "model", max_positions=1024)  # room for the schemas
    out = tmp_path / "out"
    code = cli([str(out), "--preset", "tiny", "--set", f"model.path={model}",
                "--set", f"data.files=[{write_prompts(tmp_path / 'p.jsonl', 16)}]",
                "--set", f"data.chat_template={write_tool_template(tmp_path / 't.jinja')}",
                "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]',
                "--set", 'tools=["gangtrain.tiny.tools:multiply"]',
                "--set", "environment=agent_tools:Counter",
                "--set", "generation.max_new_tokens=8", "--set", "generation.max_turns=2",
                "--set", "trainer.max_num_steps=1"])
    assert code == 0
    records = [json.loads(line) for line in
               (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert records and all(len(r["completion_mask"]) == len(r["completion_ids"])
                           for r in records)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for r in records:  # the context holds the tools' schemas and the environment's word
        context = tokenizer.decode(r["prompt_ids"])
        assert '"name": "multiply"' in context and '"name": "read"' in context
        assert "(env ready)" in context
