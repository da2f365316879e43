"""`python -m recipes.distill OUTPUT_DIR --set model.path=DIR --set teacher.path=DIR --set
'data.files=[prompts.jsonl]'`

On-policy distillation (GKD): the student samples completions of the prompts with the RL
generator, the frozen teacher scores them, the loss is TRL's generalised JSD per
completion token (`units.distill`: loss.beta 0 forward KL, 1 reverse KL, at
loss.temperature; loss.lmbda the share of on-policy micro-batches); the checkpoint best on
valid/loss exported to OUTPUT_DIR/hf/.
"""

import sys

from recipes.distill.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
