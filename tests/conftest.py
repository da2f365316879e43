import os
import sys
import time

import torch  # imported before any fork in tests.ranks

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# One intra-op thread for this process unless OMP_NUM_THREADS says otherwise: its models are
# tiny, and on the 2-vCPU VM four single-process test files (normalisation, precision, stock
# units, HF units) took 26-28 s on 1 thread against 71-85 s on torch's default 2, run after
# one another twice. The Trainer's num_threads="auto" keeps it (the user's choice);
# test_trainer/test_threads.py runs auto in fresh processes.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

_start = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"gangtrain suite time: {time.monotonic() - _start:.1f} s")
