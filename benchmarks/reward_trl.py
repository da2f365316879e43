"""Our reward model's step 1 against TRL's `RewardTrainer` (trl 1.16): the same tiny model
(the backbone of `gangtrain.tiny.chat`'s model and the score head our run draws from its
seed, saved as a sequence-classification directory TRL loads), the same 4 conversational
pairs with margins, `center_rewards_coefficient` 0.01, one micro-batch of the 4 pairs (so
the order does not matter). Step 1's loss and gradient norm are TRL's logged ones and the
ones `recipes.reward` publishes; the definitions agree (TRL's per-micro-batch means of
`-log sigmoid(r_c - r_r - m)` and `coef (r_c + r_r)^2` are our sum over pairs divided by
the pairs), and so do the rendered tokens (TRL renders the conversation and adds no second
end token after the template's `<|im_end|>\\n`).

    PYTHONPATH=DIR_WITH_TRL .venv/bin/python -m benchmarks.reward_trl [--work DIR]

Prints both and their relative gaps. Throughput is not compared here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MARGINS = (0.0, 0.5, -0.25, 1.0)
COEFFICIENT = 0.01


def prepare(work: Path) -> tuple[Path, Path]:
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


def trl(work: Path, model_dir: Path, pairs: Path) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from gangs import FakeGang, setup_gangs
    from gangtrain.models.hf import load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = load_pretrained(model_dir, setup_gangs(FakeGang()), data_parallel=None, seed=2,
                            head="sequence_classification",
                            head_config={"num_labels": 1, "pad_token_id": tokenizer.pad_token_id})
    start.save_pretrained(work / "start")  # the run's seed 2: the trainer's default
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    args = RewardConfig(output_dir=str(work / "trl"), per_device_train_batch_size=4,
                        max_steps=1, learning_rate=1e-9, logging_steps=1,
                        center_rewards_coefficient=COEFFICIENT, report_to=[],
                        save_strategy="no", use_cpu=True, bf16=False)
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(
        work / "start"), args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer)
    trainer.train()
    step1 = next(h for h in trainer.state.log_history if "loss" in h)
    return {"loss": step1["loss"], "grad_norm": step1["grad_norm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    a = parser.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="reward_trl_"))
    model_dir, pairs = prepare(work)
    found, theirs = ours(work, model_dir, pairs), trl(work, model_dir, pairs)
    for key in ("loss", "grad_norm"):
        gap = abs(found[key] - theirs[key]) / abs(theirs[key])
        print(f"step 1 {key}: ours {found[key]:.9f}, TRL {theirs[key]:.9f}, gap {gap:.1e}")


if __name__ == "__main__":
    main()
