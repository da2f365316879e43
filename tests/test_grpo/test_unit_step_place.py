"""The GRPO unit learns where optimizer steps fall from the Trainer (`set_micro_batch`), with
no copy of its accumulation: a window that fits in its step takes the ratio-1 shortcut (no
old log-probs computed), one that outlives it computes them. It states its FLOPs per target
from the training work alone (no generation): flops_per_token x the window's tokens x (1 +
a third per extra forward) / its targets, by hand."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.chat import make_tiny_chat_model
from gangtrain.tiny.prompts import write_prompts
from trainer import Trainer
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts

G, LENGTHS = 4, [3, 7, 5, 9, 4, 6, 6, 2]
FLOPS_PER_TOKEN = 6.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_place")
    model_dir = make_tiny_chat_model(base / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = read_prompts([write_prompts(base / "prompts.jsonl", 2)], tokenizer,
                           max_prompt_tokens=200)
    g = torch.Generator().manual_seed(3)
    records = [{"window": 0, "prompt_index": c // G, "sample_index": c % G,
                "prompt_ids": list(prompts[c // G].ids),
                "completion_ids": torch.randint(3, 300, (n,), generator=g).tolist(),
                "truncated": False, "rewards": {"r": float(c % 3)}}
               for c, n in enumerate(LENGTHS)]
    (base / "replay").mkdir()
    (base / "replay" / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return model_dir, prompts, records, base


@pytest.mark.parametrize(("num_accumulate", "outlives"), [(2, False), (1, True)])
def test_the_window_knows_its_step_from_the_trainer(tiny, tmp_path, num_accumulate, outlives):
    model_dir, prompts, records, base = tiny
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    unit = GRPOUnit(policy, GRPOLoss("grpo"), prompts, [],
                    Rollouts(replay=read_replay(base / "replay")), num_generations=G,
                    batch_size=4, window=2, flops_per_token=FLOPS_PER_TOKEN)
    Trainer(unit, PromptWindows(2, 2, 2, shuffle=False), torch.optim.SGD(policy.parameters(),
                                                                         lr=0.1),
            output_dir=tmp_path, max_num_steps=2 // num_accumulate,
            num_accumulate=num_accumulate, dtype="fp32", progress=False, recorders=[]).run()
    assert unit.buffer is not None
    assert [s.old is not None for s in unit.buffer.slices] == [outlives] * 2
    tokens = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in records)
    forwards = 1 if outlives else 0
    want = FLOPS_PER_TOKEN * tokens * (1 + forwards / 3) / len(records)
    assert unit.flops_per_target() == pytest.approx(want, rel=1e-12)
