"""`benchmarks` is a folder of the repository, not an installed package: make it importable
here however pytest was started (as tests/conftest.py does for the tests' helpers)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)
