"""Peak memory of one HF operation in a fresh interpreter (so no freed heap inherited from a
test process hides what it allocates). Writes `OUT_DIR/rank_{r}.json` with `growth`: by how
many bytes this rank's peak RSS (VmHWM: anonymous and file pages) rose during it.

    [torchrun ...] memory_probe.py load HF_DIR OUT_DIR fsdp|none    # load_pretrained
    memory_probe.py export STEP_DIR OUT_DIR                          # export_pretrained
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import export_pretrained, load_pretrained
from gangtrain.models.hf.load import build_on_meta
from gangtrain.models.hf.model_files import HF_FILES


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(operation: str, source: Path, out_dir: Path, data_parallel: str = "none") -> None:
    torch.set_num_threads(1)
    gangs = setup_gangs(setup_root_gang())
    # Import transformers' modules first: not the operation's memory.
    build_on_meta(source / HF_FILES if operation == "export" else source)
    gangs.root.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak RSS := current RSS
    before = status_kib("VmRSS")
    if operation == "load":
        load_pretrained(source, gangs, data_parallel=None if data_parallel == "none"
                        else data_parallel)
    else:
        export_pretrained(source, out_dir / "hf")
    growth = (status_kib("VmHWM") - before) * 1024
    (out_dir / f"rank_{gangs.root.rank}.json").write_text(json.dumps({"growth": growth}))
    gangs.root.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:])
