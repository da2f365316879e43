"""Our reward model against TRL's `RewardTrainer` (trl 1.16): step 1 equal, then throughput.

    PYTHONPATH=DIR_WITH_TRL .venv/bin/python -m benchmarks.reward_trl [--rounds 4]
        [--steps 24] [--batch 8] [--pairs 256] [--hidden 256] [--layers 4] [--work DIR]

Step 1: the same tiny model (the backbone of `gangtrain.tiny.chat`'s model and the score
head our run draws from its seed, saved as a sequence-classification directory TRL loads),
the same 4 conversational pairs with margins, `center_rewards_coefficient` 0.01, one
micro-batch of the 4 pairs (so the order does not matter). Step 1's loss and gradient norm
are TRL's logged ones and the ones `recipes.reward` publishes; the definitions agree (TRL's
per-micro-batch means of `-log sigmoid(r_c - r_r - m)` and `coef (r_c + r_r)^2` are our sum
over pairs divided by the pairs), and so do the rendered tokens (TRL renders the
conversation and adds no second end token after the template's `<|im_end|>\\n`).

Throughput: a tiny ChatML Llama of ``--hidden`` x ``--layers``, ``--pairs`` conversational
pairs (`gangtrain.tiny.pairs`), ``--batch`` pairs a step in one micro-batch, float32 on the
CPU, one intra-op thread, AdamW at a constant 1e-4 (no warm-up, no decay), gradients clipped
at 1.0 (TRL's default), max_length 128, TRL's gradient checkpointing and bf16 off (ours has
neither here); each run its own process, alternated (`benchmarks.trl_common`). Prints
pairs/s (batch over the median step time after the first 4 steps) and peak RSS, medians
over rounds, ours over TRL.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import trl_common
from benchmarks.trl_common import (
    our_step_s,
    print_gaps,
    step_timer,
    trl_first_log,
)

MARGINS = (0.0, 0.5, -0.25, 1.0)
COEFFICIENT = 0.01
LR = 1e-4
MAX_LENGTH = 128
WARMUP = 4


def step_one_inputs(work: Path) -> tuple[Path, Path]:
    """(the tiny model's directory, the 4 pairs)."""
    from gangtrain.tiny.pairs import make_tiny_chat_model, preference_pairs

    pairs = work / "four.jsonl"
    pairs.write_text("".join(json.dumps({**p, "margin": m}) + "\n"
                             for p, m in zip(preference_pairs(4, seed=5), MARGINS,
                                             strict=True)))
    return make_tiny_chat_model(work / "model"), pairs


def ours(work: Path, model_dir: Path, pairs: Path) -> dict[str, float]:
    from recipes.reward.recipe import cli

    out = work / "ours"
    assert cli([str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
                "--set", f"data.files=[{pairs}]", "--set", f"data.valid_files=[{pairs}]",
                "--set", f"loss.center_rewards_coefficient={COEFFICIENT}",
                "--set", "trainer.max_num_steps=1", "--set", "trainer.validate_every_n_steps=1",
                "--set", "trainer.checkpoint_every_n_steps=1",
                "--set", "trainer.publish_metrics_every_n_steps=1",
                "--set", f"data.cache_dir={work / 'cache'}"]) == 0
    step1 = json.loads((out / "metrics" / "train.jsonl").read_text().splitlines()[0])
    return {"loss": step1["loss"], "grad_norm": step1["grad_norm"]}


def start_model(model_dir: Path, out: Path) -> Path:
    """The run's starting model (its score head from the run's seed 2, the trainer's default)
    as a sequence-classification directory TRL loads."""
    from transformers import AutoTokenizer

    from gangs import FakeGang, setup_gangs
    from gangtrain.models.hf import load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = load_pretrained(model_dir, setup_gangs(FakeGang()), data_parallel=None, seed=2,
                            head="sequence_classification",
                            head_config={"num_labels": 1, "pad_token_id": tokenizer.pad_token_id})
    start.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trl(work: Path, model_dir: Path, pairs: Path) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    start = start_model(model_dir, work / "start")
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    args = RewardConfig(output_dir=str(work / "trl"), per_device_train_batch_size=4,
                        max_steps=1, learning_rate=1e-9, logging_steps=1,
                        center_rewards_coefficient=COEFFICIENT, report_to=[],
                        save_strategy="no", use_cpu=True, bf16=False)
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(start),
                            args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    step1 = trl_first_log(trainer)
    return {"loss": step1["loss"], "grad_norm": step1["grad_norm"]}


def ours_rate(a: argparse.Namespace) -> dict[str, float]:
    from recipes.reward.recipe import cli

    out = a.work / "ours_rate"
    assert cli([str(out), "--overwrite", "--preset", "tiny",
                "--set", f"model.path={a.work / 'rate_model'}",
                "--set", f"data.files=[{a.work / 'train.jsonl'}]",
                "--set", f"data.valid_files=[{a.work / 'valid.jsonl'}]",
                "--set", f"data.cache_dir={a.work / 'cache'}",
                "--set", f"data.seq_len={MAX_LENGTH}", "--set", f"data.batch_size={a.batch}",
                "--set", f"optimizer.lr={LR}", "--set", "optimizer.betas=[0.9,0.999]",
                "--set", "lr_scheduler.warmup_steps=0", "--set", "lr_scheduler.final_lr_scale=1.0",
                "--set", "trainer.max_gradient_norm=1.0",
                "--set", f"trainer.max_num_steps={a.steps}",
                "--set", f"trainer.validate_every_n_steps={a.steps}",
                "--set", f"trainer.checkpoint_every_n_steps={a.steps}",
                "--set", "trainer.publish_metrics_every_n_steps=1"]) == 0
    return {"pairs_per_s": a.batch / our_step_s(out, WARMUP)}


def trl_rate(a: argparse.Namespace) -> dict[str, float]:
    import statistics

    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    train = datasets.load_dataset("json", data_files=str(a.work / "train.jsonl"),
                                  split="train", cache_dir=str(a.work / "cache"))
    callback, times = step_timer()
    config = RewardConfig(
        output_dir=str(a.work / "trl_rate"), max_steps=a.steps,
        per_device_train_batch_size=a.batch, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, max_length=MAX_LENGTH, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = RewardTrainer(
        model=AutoModelForSequenceClassification.from_pretrained(a.work / "rate_start"),
        args=config, train_dataset=train,
        processing_class=AutoTokenizer.from_pretrained(a.work / "rate_model"),
        callbacks=[callback])
    trainer.train()
    return {"pairs_per_s": a.batch / statistics.median(times[WARMUP:])}


def prepare(a: argparse.Namespace, version: str) -> None:
    """The equal-step check, then the rate runs' model and data in ``a.work``."""
    work = a.work
    model_dir, pairs = step_one_inputs(work)
    print_gaps(ours(work, model_dir, pairs), trl(work, model_dir, pairs))

    from gangtrain.tiny.pairs import make_tiny_chat_model, write_pair_data

    rate_model = make_tiny_chat_model(work / "rate_model", hidden_size=a.hidden,
                                      num_layers=a.layers)
    start_model(rate_model, work / "rate_start")
    write_pair_data(work / "train.jsonl", a.pairs)
    write_pair_data(work / "valid.jsonl", 16, seed=1)
    print(f"throughput: trl {version}; model {a.hidden} x {a.layers}; {a.pairs} pairs, batch "
          f"{a.batch}, {a.steps} steps; work dir {work}")


def main() -> None:
    trl_common.main(__doc__, "benchmarks.reward_trl", "pairs_per_s", ours_rate, trl_rate,
                    prepare, pairs=256)


if __name__ == "__main__":
    main()
