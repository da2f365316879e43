"""With `return_freed_memory` (the Trainer calls it), blocks of 1 MiB or more freed by a step
leave the process's resident memory at once; without it glibc keeps them in its heap once a
larger block was freed (its dynamic mmap threshold), and a step's peak includes them."""

import subprocess
import sys

import pytest

PROBE = """
import sys
from pathlib import Path
import torch
from trainer.lifecycle.host_memory import return_freed_memory

def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "fixed":
    assert return_freed_memory()
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # a 16 MiB block freed: the threshold rises
blocks, pins = [], []
for _ in range(100):  # 2 MiB blocks (a layer's activations), small live tensors between them
    blocks.append(torch.ones(1 << 19))
    pins.append(torch.ones(16))
held = rss_mib()
del blocks
print(round(held - rss_mib()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_leave_the_resident_memory():
    """Measured: 200 of the 200 MiB freed leave the resident memory with the setting; 160
    without it (glibc keeps the rest in its heap)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, "fixed"], capture_output=True,
                          text=True, env={"PYTHONPATH": ":".join(sys.path),
                                          "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    released = int(proc.stdout.split()[-1])  # MiB of the 200 MiB freed
    assert released > 190, released
