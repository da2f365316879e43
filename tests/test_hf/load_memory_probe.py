"""Run under torchrun (or alone): `python load_memory_probe.py HF_DIR OUT_DIR fsdp|none`.
Writes `OUT_DIR/rank_{r}.json`: by how many bytes this rank's peak RSS (VmHWM: anonymous
and file pages) rose while `load_pretrained` built the model. A fresh interpreter, so no
freed heap inherited from a test process hides what the build allocates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gangs import setup_gangs, setup_root_gang
from trainer.hf import load_pretrained
from trainer.hf.load import build_on_meta


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(directory: Path, out_dir: Path, data_parallel: str | None) -> None:
    torch.set_num_threads(1)
    gangs = setup_gangs(setup_root_gang())
    build_on_meta(directory)  # imports transformers' modules: not the build's memory
    gangs.root.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak RSS := current RSS
    before = status_kib("VmRSS")
    model = load_pretrained(directory, gangs, data_parallel=data_parallel)
    growth = (status_kib("VmHWM") - before) * 1024
    num_params = sum(p.numel() for p in model.parameters())
    (out_dir / f"rank_{gangs.root.rank}.json").write_text(
        json.dumps({"growth": growth, "num_params": num_params}))
    gangs.root.barrier()


if __name__ == "__main__":
    kind = sys.argv[3]
    main(Path(sys.argv[1]), Path(sys.argv[2]), None if kind == "none" else kind)
