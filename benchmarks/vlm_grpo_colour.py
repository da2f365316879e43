"""GRPO learns from pixels: the colour filling an image, on a tiny LLaVA, through the recipes
as a user runs them.

    python -m benchmarks.vlm_grpo_colour [--steps 400] [--lr 2e-3] [--sft-steps 60] [--work DIR]

1. `recipes.sft` on grey images (`make_colour_data(blank=True)`): the model learns the answer's
   form (a colour word) but cannot see which: greedy, it answers one colour for every image,
   right on a quarter of the balanced held-out prompts (chance);
2. `recipes.grpo` from that model on the coloured images (`make_colour_prompts`), the reward
   `gangtrain.tiny.vision_tasks:colour_reward` (1 when the answer's first word is the colour),
   8 completions a prompt sampled at temperature 1, the images in the generator's prefill
   and in the trained forward.

Prints the held-out greedy accuracy (`valid/reward`: the exact-match reward of one greedy
completion a prompt) before GRPO (step 0) and after it. Not a test: a learning run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vlm_grpo_colour")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--work", type=Path, default=None)
    a = parser.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="vlm_grpo_colour_"))

    from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm
    from gangtrain.tiny.vision_tasks import make_colour_prompts
    from recipes.grpo.recipe import cli as grpo
    from recipes.sft.recipe import cli as sft

    model = make_tiny_vlm(work / "llava", "llava")
    grey = make_colour_data(work / "grey", n=64, name="train.jsonl", blank=True,
                            multi_turn_every=0)
    assert sft([str(work / "sft"), "--preset", "tiny", "--set", f"model.path={model}",
                "--set", f"data.files=[{grey}]", "--set", "data.seq_len=64",
                "--set", "data.batch_size=4", "--set", f"trainer.max_num_steps={a.sft_steps}"]) == 0
    train = make_colour_prompts(work / "prompts", n=64, name="train.jsonl")
    valid = make_colour_prompts(work / "prompts", n=16, seed=7, name="valid.jsonl")
    out = work / "grpo"
    assert grpo([str(out), "--preset", "tiny", "--set", f"model.path={work / 'sft' / 'hf'}",
                 "--set", f"data.files=[{train}]", "--set", f"data.valid_files=[{valid}]",
                 "--set", "rewards=[gangtrain.tiny.vision_tasks:colour_reward]",
                 "--set", "generation.num_generations=8", "--set", "data.batch_size=16",
                 "--set", "generation.max_new_tokens=2", "--set", f"optimizer.lr={a.lr}",
                 "--set", f"trainer.max_num_steps={a.steps}",
                 "--set", "trainer.validate_at_start=true",
                 "--set", f"trainer.validate_every_n_steps={a.steps // 4}",
                 "--set", f"trainer.checkpoint_every_n_steps={a.steps}"]) == 0
    valid_records = [json.loads(line) for path in sorted((out / "metrics").glob("valid*.jsonl"))
                     for line in path.read_text().splitlines()]
    curve = {r["step"]: r["valid/reward"] for r in valid_records if "valid/reward" in r}
    print("held-out greedy accuracy (chance 0.25): " + ", ".join(
        f"step {step} {value:.3f}" for step, value in sorted(curve.items())))


if __name__ == "__main__":
    main()
