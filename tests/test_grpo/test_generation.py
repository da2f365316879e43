"""`gangtrain.rl.generation.HFGenerator` inside the GRPO unit, through the Trainer: after each
update the generator's log-probabilities of its sampled tokens (recorded in the rollouts)
equal a full forward of the weights that sampled them; a completion depends on its seed
only, not on the batch that generates it."""

from __future__ import annotations

import copy
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.generation import HFGenerator, sample_seed
from gangtrain.rl.rewards import RewardFunction
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.prompts import low_tokens, make_tiny_chat_model, write_prompts
from trainer import Callback, Trainer
from trainer.run_dir import RunDir
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts

TEMPERATURE = 0.9


class KeepWeights(Callback):
    def __init__(self, model):
        self.model, self.weights = model, {0: copy.deepcopy(model.state_dict())}

    def on_step_end(self, trainer):
        self.weights[trainer.step_nr] = copy.deepcopy(self.model.state_dict())


def setup(tmp_path):
    model_dir = make_tiny_chat_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = read_prompts([write_prompts(tmp_path / "p.jsonl", 16)], tokenizer,
                           max_prompt_tokens=200)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # the random model rarely ends its turn: a few common tokens also stop it, so that
    # completions stop at different lengths and some run to max_new_tokens
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), *range(100, 112)]
    return model_dir, prompts, model, stop


def test_generator_logprobs_equal_a_full_forward_after_each_update(tmp_path):
    model_dir, prompts, model, stop = setup(tmp_path)
    generator = HFGenerator(model, stop_ids=stop, pad_id=0, max_new_tokens=10,
                            temperature=TEMPERATURE)
    unit = GRPOUnit(model, GRPOLoss(max_new_tokens=10), prompts,
                    [RewardFunction("low_tokens", "tiny:low_tokens", low_tokens)],
                    Rollouts(generator, file_of=RunDir(tmp_path).rollout_file),
                    num_generations=4, batch_size=8, window=1, temperature=TEMPERATURE)
    keep = KeepWeights(model)
    Trainer(unit, PromptWindows(16, 2, 1), torch.optim.AdamW(model.parameters(), lr=3e-2),
            output_dir=tmp_path / "out", max_num_steps=3, dtype="fp32", progress=False,
            callbacks=[keep]).run()
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    worst, lengths = 0.0, set()
    for step in (1, 2, 3):
        reference.load_state_dict(keep.weights[step - 1])  # the weights that sampled step N
        assert step == 1 or not torch.equal(keep.weights[step - 1]["lm_head.weight"],
                                            keep.weights[0]["lm_head.weight"])
        for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines():
            r = json.loads(line)
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            with torch.no_grad():
                logits = reference(input_ids=ids).logits[0].float() / TEMPERATURE
            p = len(r["prompt_ids"])
            full = logits.log_softmax(-1)[p - 1:-1].gather(
                -1, ids[0, p:, None])[:, 0]
            got = torch.tensor(r["logprobs"])
            worst = max(worst, float((got - full).abs().max()))
            lengths.add(len(r["completion_ids"]))
    assert worst < 1e-5, worst
    assert len(lengths) > 1  # unequal lengths: stops and cuts both seen


def test_a_completion_depends_on_its_seed_not_on_its_batch(tmp_path):
    _, prompts, model, stop = setup(tmp_path)
    generator = HFGenerator(model, stop_ids=stop, pad_id=0, max_new_tokens=10, temperature=1.0)
    rows = [prompts[i].ids for i in range(6)]
    seeds = [sample_seed(0, 0, i, 0) for i in range(6)]
    together = generator.generate(rows, seeds)
    alone = [generator.generate([r], [s])[0] for r, s in zip(rows, seeds, strict=True)]
    reversed_ = generator.generate(rows[::-1], seeds[::-1])[::-1]
    assert [c.ids for c in together] == [c.ids for c in alone] == [c.ids for c in reversed_]
    for a, b in zip(together, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    assert len({c.ids for c in together}) == 6


def generate_on_fsdp2_ranks(model_dir, rows, seeds):
    """Rank 0's completions all stop at their first token, rank 1's run to the limit: the
    ranks must keep stepping together (each forward all-gathers the FSDP2 shards)."""
    from gangs import setup_gangs, setup_root_gang
    from gangtrain.models.hf import load_pretrained

    gangs = setup_gangs(setup_root_gang())
    model = load_pretrained(model_dir, gangs, data_parallel="fsdp")
    stop = list(range(320)) if gangs.dp.rank == 0 else [10_000]
    generator = HFGenerator(model, stop_ids=stop, pad_id=0, max_new_tokens=6, gang=gangs.dp)
    return [c.ids for c in generator.generate(rows, seeds)]


def test_fsdp2_ranks_finishing_at_different_lengths_do_not_hang(tmp_path):
    from functools import partial

    from ranks import run_ranks

    model_dir, prompts, model, _ = setup(tmp_path)
    rows, seeds = [prompts[0].ids, prompts[1].ids], [11, 12]
    first, second = run_ranks(partial(generate_on_fsdp2_ranks, model_dir, rows, seeds),
                              world_size=2, timeout=90)
    assert [len(ids) for ids in first] == [1, 1] and [len(ids) for ids in second] == [6, 6]
    # the sharded model samples what the whole one samples with the same seeds
    alone = HFGenerator(model, stop_ids=[10_000], pad_id=0, max_new_tokens=6)
    assert [c.ids for c in alone.generate(rows, seeds)] == second
