import os
import sys
import time

import torch  # noqa: F401  (imported before any fork in tests.ranks)

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

_start = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"gangtrain suite time: {time.monotonic() - _start:.1f} s")
