"""Image records decoded in the loader's workers against in the training process.

    python -m benchmarks.vlm_workers [--family qwen2_vl] [--workers 2] [--rounds 3]
        [--steps 60] [--image-size 448] [--records 64]

A tiny VLM (`gangtrain.tiny.vision`) trained on the colour task through `python -m
recipes.sft` (packed rows of 64 tokens, 4 a step, the tower frozen), each run a fresh
process, alternating A (`data.num_workers` unset: the processor runs in the training process)
and B (`data.num_workers=N`), `--rounds` times. Images of `--image-size` pixels a side, which
the processor resizes (decoding and resizing them is the work the workers take over). Prints
per run the steps/s the Trainer published (median over its publishes after the first) and its
`data_wait_fraction`, then the median over rounds of B / A, and whether the losses were the
same bit for bit (they must be: the same micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, model: Path, data: Path, args: argparse.Namespace, workers: int) -> dict:
    extra = ["--set", f"data.num_workers={workers}"] if workers else []
    command = [sys.executable, "-m", "recipes.sft", str(out), "--preset", "tiny",
               "--set", f"model.path={model}", "--set", f"data.files=[{data}]",
               "--set", "model.freeze=[vision_tower]", "--set", "data.seq_len=64",
               "--set", "data.batch_size=4", "--set", f"trainer.max_num_steps={args.steps}",
               "--set", f"trainer.validate_every_n_steps={args.steps}",
               "--set", f"trainer.checkpoint_every_n_steps={args.steps}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics" / "train.jsonl").read_text()
               .splitlines()]
    later = records[1:] or records
    return {"steps_per_s": statistics.median(r["steps_per_s"] for r in later),
            "data_wait": statistics.median(r["data_wait_fraction"] for r in later),
            "losses": [r["loss"] for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--records", type=int, default=64)
    args = parser.parse_args()
    from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_vlm(root / "model", args.family)
        data = make_colour_data(root / "data", n=args.records, sizes=(args.image_size,))
        print(f"{args.family}, {args.records} records, images {args.image_size} px, "
              f"{args.steps} steps a run, {args.rounds} rounds, A: no workers, "
              f"B: data.num_workers={args.workers}; {os.cpu_count()} cores")
        ratios, same = [], True
        for r in range(args.rounds):
            a = run(root / f"a{r}", model, data, args, 0)
            b = run(root / f"b{r}", model, data, args, args.workers)
            same = same and a["losses"] == b["losses"]
            ratios.append(b["steps_per_s"] / a["steps_per_s"])
            print(f"round {r + 1}: A {a['steps_per_s']:.2f} steps/s (data wait "
                  f"{a['data_wait']:.2f}), B {b['steps_per_s']:.2f} steps/s (data wait "
                  f"{b['data_wait']:.2f}): B / A {ratios[-1]:.2f}")
        print(f"workers / in process, steps/s: median {statistics.median(ratios):.2f}x "
              f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); losses bit-equal: {same}")


if __name__ == "__main__":
    main()
