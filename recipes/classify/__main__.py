"""`python -m recipes.classify OUTPUT_DIR [--preset tiny|default] [--set a.b=v ...]`

An MLP classifier on interleaved spirals generated in code, with label noise: validation
accuracy plateaus below 100%, and early stopping by patience ends the run; the best step's
checkpoint is kept.
"""

import sys

from gangtrain.app.cli import run_recipe
from recipes.classify.config import PRESETS, ClassifyConfig
from recipes.classify.recipe import eval_main, main

if __name__ == "__main__":
    sys.exit(run_recipe(ClassifyConfig, PRESETS, main, prog="python -m recipes.classify",
                        default_preset="default", eval_main=eval_main))
