"""`python -m recipes.posttrain OUTPUT_DIR --set objective=NAME_OR_PATH [--set ...]`

Runs the objective the config names (`objective`: sft, finetune, preference, grpo, or a
user's own `"pkg.mod:MyObjective"`, a subclass of `gangtrain.posttrain.Objective`) through
the post-training assembly, with the objective's config and presets.
"""

import sys

from recipes.posttrain.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
