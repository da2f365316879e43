"""The family x layout matrix of tensor and expert parallelism, longer than the tests: every
family of `tests/model_families.py` saved by `save_pretrained`, loaded by `load_pretrained`,
trained `--steps` steps through the Trainer in one process, under TP2 and (MoE families)
EP2 on 2 forked Gloo ranks; printed: each layout's largest relative loss gap (train and valid)
to one process, and the largest gap of a weight's change (in units of the tests' allowance:
2e-4 of the change + 2 float32 ulp of the weight), or the message of a refusal.

    python -m benchmarks.family_tp_ep [--steps 4] [--families llama qwen3 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "test_models")]

from family_runs import train_family  # noqa: E402
from model_families import FAMILIES, MOE_FAMILIES, save_tiny  # noqa: E402
from ranks import run_ranks  # noqa: E402

from trainer.errors import UserError  # noqa: E402

LAYOUTS = {"one": {}, "tp2": {"tp_size": 2}, "ep2": {"ep_size": 2}}


def train_each(dirs: dict[str, Path], root: Path, steps: int, layout: str) -> dict:
    """Each family's run under `layout`, or the message of its refusal."""
    results = {}
    for family, directory in dirs.items():
        try:
            results[family] = train_family(directory, root / f"{family}-{layout}",
                                           max_num_steps=steps, **LAYOUTS[layout])
        except UserError as error:
            results[family] = str(error)
    return results


def compare(run, one, directory: Path) -> str:
    from transformers import AutoModelForCausalLM

    if isinstance(run, str):
        return f"refused: {run[:150]}"
    losses = zip(run.train_losses + run.valid_losses, one.train_losses + one.valid_losses,
                 strict=True)
    loss_gap = max(abs(a - b) / abs(b) for a, b in losses)
    initial = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    update_gap = max(((run.params[n] - one.params[n]).abs().max()
                      / (2e-4 * (one.params[n] - initial[n]).abs().max()
                         + 2.4e-7 * initial[n].abs().max())).item() for n in one.params)
    return f"loss gap {loss_gap:.1e}, update gap {update_gap:.2f} of allowed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = {family: save_tiny(family, root / family) for family in args.families}
        results = {"one": run_ranks(partial(train_each, dirs, root, args.steps, "one"),
                                    world_size=1)[0]}
        for layout in ("tp2", "ep2"):
            results[layout] = run_ranks(partial(train_each, dirs, root, args.steps, layout),
                                        world_size=2, timeout=600)[0]
        print(f"{args.steps} steps, SGD lr 0.5, clipped to norm 0.2, global batch 8")
        for family in args.families:
            one = results["one"][family]
            print(f"{family:10s} one process: train losses "
                  f"{[round(x, 4) for x in one.train_losses]}")
            for layout in ("tp2", "ep2"):
                if layout == "ep2" and family not in MOE_FAMILIES:
                    continue
                print(f"{'':10s} {layout}: {compare(results[layout][family], one, dirs[family])}")


if __name__ == "__main__":
    main()
