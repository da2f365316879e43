"""The LM recipe's own mixture of experts (`model.num_experts`) with its load-balancing loss,
through `python -m recipes.lm --preset tiny`, on every layout that takes it, against one
process.

    python -m benchmarks.lm_moe_aux_layouts                    # weight 0.5, 6 steps
    python -m benchmarks.lm_moe_aux_layouts --weight 0.01 --layouts dp2 cp2_ep2

Each layout is the recipe's own command under `torch.distributed.run` (Gloo, one thread a
rank). Printed: the largest relative gap of the train and valid losses to one process. The
rule (the global micro-batch's aux loss, counts summed over dp and cp) is in
`units/router_aux_loss.py` and docs/models.md; `tests/test_recipes/test_recipe_lm_pp_cp.py`
runs EP2 and CP2 of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"dp2": (2, ()), "ep2": (2, ("gangs.ep_size=2",)),
           "ep2_fsdp2": (2, ("gangs.ep_size=2", "trainer.data_parallel=fsdp")),
           "cp2": (2, ("gangs.cp_size=2",)),
           "cp2_ep2": (4, ("gangs.cp_size=2", "gangs.ep_size=2")),
           "dp4_ep2": (4, ("gangs.ep_size=2",))}


def run(out: Path, ranks: int, settings: list[str]) -> dict[str, list[float]]:
    launcher = [sys.executable, "-m", "recipes.lm"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "-m", "recipes.lm"]
    args = [a for s in settings for a in ("--set", s)]
    proc = subprocess.run([*launcher, str(out), "--preset", "tiny", "--no-resume", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{out.name} failed:\n{proc.stderr[-3000:]}")
    return {section: [json.loads(line)[key] for line in
                      (out / "metrics" / f"{section}.jsonl").read_text().splitlines()]
            for section, key in (("train", "loss"), ("valid", "valid/loss"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_moe_aux_layouts")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--weight", type=float, default=0.5)
    args = parser.parse_args(argv)
    common = [f"trainer.max_num_steps={args.steps}", "trainer.validate_every_n_steps=3",
              f"trainer.checkpoint_every_n_steps={args.steps}", "trainer.progress=false",
              "trainer.publish_metrics_every_n_steps=1", "trainer.num_accumulate=2",
              "model.num_experts=4", f"model.moe_aux_loss_weight={args.weight}",
              "gangs.timeout_s=60"]
    with tempfile.TemporaryDirectory() as tmp:
        reference = run(Path(tmp) / "one", 1, common)
        print(f"recipes.lm tiny, model.num_experts=4, moe_aux_loss_weight {args.weight}, "
              f"{args.steps} steps of 2 micro-batches; largest relative gap of train and "
              "valid losses to one process", flush=True)
        for name in args.layouts:
            ranks, settings = LAYOUTS[name]
            got = run(Path(tmp) / name, ranks, [*common, *settings])
            gap = max(abs(a - b) / abs(b) for section in ("train", "valid")
                      for a, b in zip(got[section], reference[section], strict=True))
            print(f"  {name:<10} {ranks} ranks  {gap:.1e}", flush=True)


if __name__ == "__main__":
    main()
