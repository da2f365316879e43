import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # run_gate, for in-process runs too
