"""`python -m recipes.reward OUTPUT_DIR --set model.path=DIR --set 'data.files=[pairs.jsonl]'`

A reward model (`AutoModelForSequenceClassification`, one label) trained from a local
Hugging Face causal LM on pairs in TRL's formats (`prompt`, `chosen`, `rejected` as text or
messages; or two conversations sharing the prompt; an optional `margin`), the
Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected - margin)` (`units.reward`); the
checkpoint best on valid accuracy exported to OUTPUT_DIR/hf/ (and OUTPUT_DIR/adapter/ with
LoRA).
"""

import sys

from recipes.reward.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
