"""The MoE families with their router's auxiliary loss ON, through `recipes.sft`, on every
layout that takes a mixture of experts, against one process.

    python -m benchmarks.router_aux_layouts                 # Qwen3-MoE and Mixtral, 6 steps
    python -m benchmarks.router_aux_layouts --steps 10 --coef 0.1

The tiny MoE models of `tests/model_families.py` (as `benchmarks.family_matrix` prepares
them), their config asking for the aux loss (`output_router_logits`, `router_aux_loss_coef`);
each layout on forked Gloo ranks running the recipe's own `cli`. Printed: the largest relative
gap of the train and valid losses to one process, or the refusal. The rule they follow
(the global micro-batch's aux loss) is in `units/router_aux_loss.py` and docs/models.md;
`tests/test_models/test_router_aux_loss_layouts.py` runs DP2 and EP2 of it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.family_matrix import LAYOUTS, Layout, prepare, relative_gap, run_layout

# Layouts of a mixture of experts beyond the matrix's (EP carved out of DP).
MOE_LAYOUTS = {"ep2": Layout(2, ("gangs.ep_size=2",)),
               "ep2_tp2": Layout(4, ("gangs.ep_size=2", "gangs.tp_size=2",
                                     "trainer.data_parallel=ddp")),
               "ep2_dp4": Layout(4, ("gangs.ep_size=2",))}


def ask_for_aux_loss(model_dir: Path, coef: float) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=coef)
    (model_dir / "config.json").write_text(json.dumps(config))


def main(argv: list[str] | None = None) -> None:
    from model_families import MOE_FAMILIES  # tests/ is on the path once family_matrix is

    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_aux_layouts")
    parser.add_argument("--families", nargs="*", default=list(MOE_FAMILIES))
    parser.add_argument("--layouts", nargs="*",
                        default=["fsdp2", "ep2", "cp2", "ep2_dp4", "cp2_fsdp2", "pp2"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--coef", type=float, default=0.5)
    args = parser.parse_args(argv)
    for name, layout in MOE_LAYOUTS.items():
        LAYOUTS.setdefault(name, layout)
    families = tuple(args.families)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(Path(tmp), families)
        for family in families:
            ask_for_aux_loss(paths["models"][family], args.coef)
        reference = run_layout(paths, families, "one", args.steps)
        print(f"recipes.sft, aux loss on (coef {args.coef}), {args.steps} steps of 2 "
              "micro-batches of 4 rows x 64 tokens; largest relative gap of train and valid "
              "losses to one process", flush=True)
        for name in args.layouts:
            for family, got in run_layout(paths, families, name, args.steps).items():
                cell = got if isinstance(got, str) else \
                    f"{relative_gap(got, reference[family]):.1e}"
                print(f"  {name:<10} {family:<10} {cell}", flush=True)


if __name__ == "__main__":
    main()
