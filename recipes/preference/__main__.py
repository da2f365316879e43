"""`python -m recipes.preference OUTPUT_DIR --set model.path=DIR --set 'data.files=[pairs.jsonl]'`

Preference tuning of a local Hugging Face causal LM on pairs in TRL's formats (`prompt`,
`chosen`, `rejected` as text or messages; or two conversations sharing the prompt), with
`loss.kind` dpo, ipo, simpo or orpo (`units.preference`), or kto on TRL's unpaired
examples (`prompt`, `completion`, `label`); the reference model a frozen copy
laid out like the policy, or with LoRA the base with its adapters disabled; the best
checkpoint exported to OUTPUT_DIR/hf/ (and OUTPUT_DIR/adapter/ with LoRA).
"""

import sys

from recipes.preference.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
