"""A reward model trained here, used as the reward of a GRPO run, makes that run's reward rise.

    .venv/bin/python -m benchmarks.reward_to_grpo [--sft-steps 150] [--rm-steps 40]
        [--grpo-steps 30] [--grpo-lr 3e-4] [--seed 0] [--work DIR]

Three runs through the recipes' command lines, each its own process:

1. SFT (`recipes.sft`): the tiny chat model (`gangtrain.tiny.chat`) learns to answer the
   arithmetic prompts of `gangtrain.tiny.prompts` in two forms, half each: the sentence
   ("7 plus 5 is 12.") and the bare number ("12."). Sampled at temperature 1 it then writes
   both, so a preference between them has something to move.
2. A reward model (`recipes.reward`) from the SFT model's backbone, on pairs of other
   prompts that prefer the sentence to the bare number (a preference a tiny model learns in
   a few dozen steps); its exported `OUT/hf` is the reward.
3. GRPO (`recipes.grpo`) from the SFT model with ``rewards=[{model: RM/hf}]`` (`ModelReward`)
   on further prompts, the mean sampled reward published every step.

Prints the reward model's valid accuracy, the per-step GRPO reward means, the mean of the
first and last 10% of the steps (at least 2 each) and the share of bare-number answers
among the sampled completions at the first and last step, with each phase's wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.trl_common import our_train_records, run_child

BARE = re.compile(r"^\s*-?\d+\.\s*$")


def answers(record: dict) -> tuple[str, str]:
    """(the sentence, the bare number) answering a `prompt_records` record."""
    question = record["prompt"][0]["content"]
    return f"{question[len('What is '):-1]} is {record['answer']}.", f"{record['answer']}."


def write_data(work: Path) -> dict[str, Path]:
    """SFT conversations (the two forms alternating), preference pairs (the sentence
    chosen), held-out pairs, GRPO prompts; each from its own seed."""
    from gangtrain.tiny.prompts import prompt_records, write_prompts

    def jsonl(name: str, records: list[dict]) -> Path:
        path = work / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    sft = [{"messages": [*r["prompt"], {"role": "assistant", "content": answers(r)[i % 2]}]}
           for i, r in enumerate(prompt_records(2000, seed=20))]

    def pairs(num: int, seed: int) -> list[dict]:
        return [{"prompt": r["prompt"],
                 "chosen": [{"role": "assistant", "content": answers(r)[0]}],
                 "rejected": [{"role": "assistant", "content": answers(r)[1]}]}
                for r in prompt_records(num, seed=seed)]

    return {"sft": jsonl("sft.jsonl", sft), "pairs": jsonl("pairs.jsonl", pairs(400, 21)),
            "valid_pairs": jsonl("valid_pairs.jsonl", pairs(32, 22)),
            "prompts": write_prompts(work / "prompts.jsonl", 512, seed=23)}


def recipe(module: str, out: Path, *settings: str) -> float:
    """Run `python -m module out --overwrite --preset tiny ...` (its own process through
    `benchmarks.trl_common.run_child`'s environment); its wall seconds."""
    start = time.perf_counter()
    run_child("benchmarks.reward_to_grpo", ["--recipe", module, str(out), *settings])
    return time.perf_counter() - start


def bare_share(rollouts: Path, step: int) -> float | None:
    """The share of step `step`'s sampled completions that are a bare number (the form the
    reward model learnt to rank below the sentence)."""
    path = rollouts / f"step_{step}.jsonl"
    if not path.is_file():
        return None
    texts = [json.loads(line)["completion"] for line in path.read_text().splitlines()]
    texts = ["".join(m["content"] for m in t) if isinstance(t, list) else t for t in texts]
    return sum(bool(BARE.match(t)) for t in texts) / len(texts) if texts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rm-steps", type=int, default=40)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--grpo-lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0, help="GRPO's trainer.seed (its samples)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--recipe", nargs=argparse.REMAINDER, default=None)
    a = parser.parse_args()
    if a.recipe is not None:  # a child: one recipe's command line
        import importlib

        code = importlib.import_module(f"{a.recipe[0]}.recipe").cli(
            [a.recipe[1], "--overwrite", "--preset", "tiny", *a.recipe[2:]])
        if code != 0:
            raise SystemExit(code)
        print("RESULT {}")
        return
    from gangtrain.tiny.pairs import make_tiny_chat_model

    work = a.work or Path(tempfile.mkdtemp(prefix="reward_to_grpo_"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work)
    base = make_tiny_chat_model(work / "model")
    sft_s = recipe("recipes.sft", work / "sft", "--set", f"model.path={base}",
                   "--set", f"data.files=[{data['sft']}]", "--set", "data.seq_len=64",
                   "--set", "data.batch_size=16", "--set", f"trainer.max_num_steps={a.sft_steps}",
                   "--set", f"trainer.validate_every_n_steps={a.sft_steps}",
                   "--set", f"trainer.checkpoint_every_n_steps={a.sft_steps}")
    rm_s = recipe("recipes.reward", work / "rm", "--set", f"model.path={work / 'sft' / 'hf'}",
                  "--set", f"data.files=[{data['pairs']}]",
                  "--set", f"data.valid_files=[{data['valid_pairs']}]",
                  "--set", "data.batch_size=8", "--set", f"trainer.max_num_steps={a.rm_steps}",
                  "--set", f"trainer.validate_every_n_steps={a.rm_steps // 2}",
                  "--set", f"trainer.checkpoint_every_n_steps={a.rm_steps // 2}")
    rm_valid = [json.loads(line) for line in (work / "rm" / "metrics" / "valid.jsonl")
                .read_text().splitlines() if "valid/accuracy" in line]
    grpo_s = recipe("recipes.grpo", work / "grpo", "--set", f"model.path={work / 'sft' / 'hf'}",
                    "--set", f"data.files=[{data['prompts']}]",
                    "--set", f"rewards=[{{model: {work / 'rm' / 'hf'}}}]",
                    "--set", "data.batch_size=32", "--set", "generation.num_generations=8",
                    "--set", "generation.max_new_tokens=16", "--set", f"optimizer.lr={a.grpo_lr}",
                    "--set", f"trainer.max_num_steps={a.grpo_steps}",
                    "--set", f"trainer.checkpoint_every_n_steps={a.grpo_steps}",
                    "--set", f"trainer.validate_every_n_steps={a.grpo_steps}",
                    "--set", "trainer.publish_metrics_every_n_steps=1",
                    "--set", f"trainer.seed={a.seed}")
    rewards = [r["reward"] for r in our_train_records(work / "grpo")]
    tenth = max(2, len(rewards) // 10)
    first, last = statistics.mean(rewards[:tenth]), statistics.mean(rewards[-tenth:])
    print(f"work dir {work}; SFT {a.sft_steps} steps {sft_s:.0f} s, reward model "
          f"{a.rm_steps} steps {rm_s:.0f} s, GRPO {a.grpo_steps} steps {grpo_s:.0f} s")
    print("reward model valid accuracy: " + ", ".join(
        f"step {r['step']} {r['valid/accuracy']:.3f}" for r in rm_valid))
    print("GRPO reward mean per step: " + " ".join(f"{r:.3f}" for r in rewards))
    rollouts = work / "grpo" / "rollouts"
    shares = [bare_share(rollouts, s) for s in (1, len(rewards))]
    print(f"first {tenth} steps' mean {first:.4f}, last {tenth} steps' mean {last:.4f}: "
          f"{'rose' if last > first else 'did not rise'} by {last - first:+.4f}; bare-number "
          f"answers among the samples: step 1 {shares[0]:.3f}, step {len(rewards)} "
          f"{shares[1]:.3f}")


if __name__ == "__main__":
    main()
