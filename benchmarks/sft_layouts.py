"""SFT with clipping on every layout against one process: the largest relative gap of the
train and valid losses over a run (a norm that changes with the layout shows here: clipping
carries it into the weights).

    .venv/bin/python -m benchmarks.sft_layouts [--steps 60] [--layouts ddp,fsdp2,tp2]

Makes the tiny chat model and data (`gangtrain.tiny.chat`), runs `python -m recipes.sft` with
the tiny preset (fp32, clipping at norm 1) for ``--steps`` steps, publishing every step, in
one process, then under torchrun on 2 ranks per layout, and prints, per layout, the largest
relative gap to one process of the train loss, the gradient norm and the valid loss.
tests/test_recipes/test_recipe_sft.py runs the same comparison for FSDP2 and TP2 at 1e-6.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "ddp": ["--set", "trainer.data_parallel=ddp"],
    "fsdp2": [],
    "tp2": ["--set", "gangs.tp_size=2", "--set", "trainer.data_parallel=ddp"],
}


def records(out: Path, section: str) -> dict[int, dict]:
    lines = (out / "metrics" / f"{section}.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def largest_gap(run: dict[int, dict], reference: dict[int, dict], key: str) -> float:
    return max(abs(run[s][key] / reference[s][key] - 1) for s in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data

    base = Path(tempfile.mkdtemp(prefix="sft_layouts_"))
    model, chat = make_tiny_chat_model(base / "model"), write_chat_data(base / "chat.jsonl", 600)
    common = ["--preset", "tiny", "--set", f"model.path={model}", "--set", f"data.files=[{chat}]",
              "--set", f"data.cache_dir={base / 'cache'}", "--set", f"trainer.max_num_steps={args.steps}",
              "--set", "trainer.publish_metrics_every_n_steps=1", "--set", "gangs.timeout_s=120"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(name: str, launcher: list[str], extra: list[str]) -> Path:
        out = base / name
        subprocess.run([sys.executable, "-m", *launcher, "recipes.sft", str(out), *common, *extra],
                       check=True, env=env, capture_output=True)
        return out

    one = run("one", [], [])
    reference = {section: records(one, section) for section in ("train", "valid")}
    print(f"SFT tiny preset, {args.steps} steps, clipping at 1.0; largest relative gap to one "
          "process:")
    for name in args.layouts.split(","):
        out = run(name, ["torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"],
                  LAYOUTS[name])
        train, valid = records(out, "train"), records(out, "valid")
        print(f"  {name:6s} train loss {largest_gap(train, reference['train'], 'loss'):.1e}"
              f"  grad norm {largest_gap(train, reference['train'], 'grad_norm'):.1e}"
              f"  valid loss {largest_gap(valid, reference['valid'], 'valid/loss'):.1e}")


if __name__ == "__main__":
    main()
