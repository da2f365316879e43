"""`python -m recipes.grpo OUTPUT_DIR --set model.path=DIR --set 'data.files=[prompts.jsonl]'
--set 'rewards=["pkg.mod:fn"]'`

Online RL of a local Hugging Face causal LM: completions sampled by the policy inside the
unit, scored by reward functions (TRL's calling convention), `loss.kind` grpo, dapo, dr_grpo
or rloo (`units.online_rl`); rollouts in OUTPUT_DIR/rollouts/; the best checkpoint exported
to OUTPUT_DIR/hf/. See docs/grpo.md.
"""

import sys

from recipes.grpo.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
