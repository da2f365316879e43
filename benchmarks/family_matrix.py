"""Every model family under every layout, through `recipes.sft`, against one process.

    python -m benchmarks.family_matrix                      # every family x layout, 6 steps
    python -m benchmarks.family_matrix --families mistral gemma2 --steps 10

For each family of `tests/model_families.py` (tiny random models saved with transformers'
own `save_pretrained`, a ChatML tokenizer beside them) the SFT recipe trains a few steps on
one process, then on each layout (forked Gloo ranks running the recipe's own `cli`), and the
largest relative gap of the train and valid losses to one process is printed per cell, or
the refusal (the first line of the recipe's `error:`). The tests run a slice of this
(`tests/test_models/test_family_layouts.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tiny families and forked ranks of the tests

import torch  # noqa: E402  (imported before any fork)
from model_families import FAMILIES, tiny_model  # noqa: E402
from ranks import run_ranks  # noqa: E402

__all__ = ["LAYOUTS", "Layout", "prepare", "relative_gap", "run_layout"]


@dataclass(frozen=True)
class Layout:
    ranks: int
    settings: tuple[str, ...] = ()


# The micro-batches a step (trainer.num_accumulate) are the schedule's under PP: 2 everywhere.
LAYOUTS: dict[str, Layout] = {
    "one": Layout(1),
    "fsdp2": Layout(2),
    "pp2": Layout(2, ("gangs.pp_size=2", "trainer.data_parallel=ddp")),
    "pp2_gpipe": Layout(2, ("gangs.pp_size=2", "gangs.pp_schedule=gpipe",
                            "trainer.data_parallel=ddp")),
    "pp2_interleaved": Layout(2, ("gangs.pp_size=2", "gangs.pp_schedule=interleaved_1f1b",
                                  "trainer.data_parallel=ddp")),
    "pp2_zbv": Layout(2, ("gangs.pp_size=2", "gangs.pp_schedule=zbv_zero_bubble",
                          "trainer.data_parallel=ddp")),
    "cp2": Layout(2, ("gangs.cp_size=2",)),
    "tp2": Layout(2, ("gangs.tp_size=2", "trainer.data_parallel=ddp")),
    "pp2_tp2": Layout(4, ("gangs.pp_size=2", "gangs.tp_size=2", "trainer.data_parallel=ddp")),
    "pp2_dp2": Layout(4, ("gangs.pp_size=2", "trainer.data_parallel=ddp")),
    # Each stage sharded over its 2 DP ranks (the recipe's default trainer.data_parallel=fsdp).
    "pp2_fsdp2": Layout(4, ("gangs.pp_size=2",)),
    "pp2_hsdp": Layout(4, ("gangs.pp_size=2", "gangs.dp_shard_size=1")),
    "pp2_fsdp2_tp2": Layout(8, ("gangs.pp_size=2", "gangs.tp_size=2")),
    "cp2_tp2": Layout(4, ("gangs.cp_size=2", "gangs.tp_size=2",
                          "trainer.data_parallel=ddp")),
    "cp2_fsdp2": Layout(4, ("gangs.cp_size=2",)),
    "cp2_hsdp": Layout(4, ("gangs.cp_size=2", "gangs.dp_shard_size=1")),
    # MoE families only (the others refuse ep_size by name).
    "pp2_ep2": Layout(4, ("gangs.pp_size=2", "gangs.ep_size=2")),
    "cp2_ep2": Layout(4, ("gangs.cp_size=2", "gangs.ep_size=2")),
}


def prepare(base: Path, families: tuple[str, ...], conversations: int = 48) -> dict[str, Any]:
    """A model directory per family (its tiny random model, the vocabulary grown to the
    ChatML tokenizer's) and the chat data, under `base`."""
    from transformers import AutoTokenizer

    from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data

    tokenizer = AutoTokenizer.from_pretrained(
        make_tiny_chat_model(base / "tokenizer", hidden_size=8, num_layers=1))
    models = {}
    for family in families:
        model = tiny_model(family)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        model.save_pretrained(base / family)
        tokenizer.save_pretrained(base / family)
        models[family] = base / family
    return {"models": models, "chat": write_chat_data(base / "chat.jsonl", conversations),
            "cache": base / "cache", "out": base / "runs"}


def _settings(paths: dict[str, Any], family: str, layout: str, steps: int) -> list[str]:
    settings = [f"model.path={paths['models'][family]}", f"data.files=[{paths['chat']}]",
                f"data.cache_dir={paths['cache']}", "data.seq_len=64", "data.batch_size=4",
                "data.valid_batch_size=8", "trainer.num_accumulate=2",
                f"trainer.max_num_steps={steps}", f"trainer.validate_every_n_steps={steps}",
                f"trainer.checkpoint_every_n_steps={steps}",
                "trainer.publish_metrics_every_n_steps=1", "gangs.timeout_s=60",
                *LAYOUTS[layout].settings]
    return [x for s in settings for x in ("--set", s)]


def _losses(out: Path) -> dict[str, dict[int, float]]:
    result = {}
    for section, key in (("train", "loss"), ("valid", "valid/loss")):
        lines = (out / "metrics" / f"{section}.jsonl").read_text().splitlines()
        result[section] = {r["step"]: r[key] for r in map(json.loads, lines) if key in r}
    return result


def _run_family(paths: dict[str, Any], family: str, layout: str, steps: int) -> Any:
    """On every rank: the recipe as `python -m recipes.sft` runs it (its `cli`); the losses
    rank 0 recorded, or the refusal."""
    from recipes.sft.recipe import cli

    out = paths["out"] / layout / family
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = cli([str(out), "--preset", "tiny", "--no-resume",
                    *_settings(paths, family, layout, steps)])
    if code != 0:
        errors = [line for line in printed.getvalue().splitlines() if "error" in line]
        return f"refused: {errors[0] if errors else printed.getvalue()[-300:]}"
    return _losses(out) if (out / "metrics").is_dir() else None


def run_layout(paths: dict[str, Any], families: tuple[str, ...], layout: str,
               steps: int) -> dict[str, Any]:
    """`{family: {"train": {step: loss}, "valid": {...}} or "refused: ..."}` of `layout`:
    each family on fresh forked ranks (the recipe closes its process group at the end)."""
    results: dict[str, Any] = {}
    for family in families:
        try:
            results[family] = run_ranks(partial(_run_family, paths, family, layout, steps),
                                        world_size=LAYOUTS[layout].ranks, timeout=600)[0]
        except AssertionError as error:  # a rank raised: a bug, shown as such
            results[family] = f"FAILED: {str(error).strip().splitlines()[-1]}"
    return results


def relative_gap(result: Any, reference: Any) -> float:
    """The largest relative gap of `result`'s train and valid losses to `reference`'s."""
    gaps = []
    for section in ("train", "valid"):
        ref, got = reference[section], result[section]
        if ref.keys() != got.keys():
            raise AssertionError(f"{section} steps {sorted(got)} != {sorted(ref)}")
        gaps += [abs(got[s] - ref[s]) / abs(ref[s]) for s in ref]
    return max(gaps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.family_matrix")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--layouts", nargs="*", default=[k for k in LAYOUTS if k != "one"])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    families = tuple(args.families)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(Path(tmp), families)
        reference = run_layout(paths, families, "one", args.steps)
        print(f"recipes.sft, {args.steps} steps of 2 micro-batches of 4 rows x 64 tokens; "
              "largest relative gap of train and valid losses to one process", flush=True)
        table = {}
        for name in args.layouts:  # each cell as it comes (a run can take minutes)
            table[name] = run_layout(paths, families, name, args.steps)
            for family, got in table[name].items():
                cell = got if isinstance(got, str) else \
                    f"{relative_gap(got, reference[family]):.1e}"
                print(f"  {name} {family}: {cell}", flush=True)
        print(f"{'family':<10}" + "".join(f"{name:>16}" for name in args.layouts))
        for family in families:
            cells = []
            for name in args.layouts:
                got = table[name][family]
                cells.append(got[:15] if isinstance(got, str) else
                             f"{relative_gap(got, reference[family]):.1e}")
            print(f"{family:<10}" + "".join(f"{cell:>16}" for cell in cells))
        for name in args.layouts:
            for family in families:
                if isinstance(table[name][family], str):
                    print(f"{name} {family}: {table[name][family]}")


if __name__ == "__main__":
    main()
