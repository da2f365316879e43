"""`python -m recipes.lm OUTPUT_DIR [--preset tiny|cpu|gpu] [--set a.b=v ...]`

A byte-level GPT trained on the Python standard library's own source: real data that ships
with every Python install, and a reference to beat (gzip -9 on the same held-out bytes).
"""

import sys

from gangtrain.app.cli import run_recipe
from recipes.lm.config import PRESETS, RESUME_GUARD, LMConfig
from recipes.lm.recipe import eval_main, main

if __name__ == "__main__":
    sys.exit(run_recipe(LMConfig, PRESETS, main, prog="python -m recipes.lm",
                        default_preset="cpu", resume_guard=RESUME_GUARD, eval_main=eval_main))
