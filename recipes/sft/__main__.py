"""`python -m recipes.sft OUTPUT_DIR --set model.path=DIR --set 'data.files=[chat.jsonl]'`

Supervised fine-tuning of a local Hugging Face causal LM on conversations (`messages`),
prompt/completion pairs or plain text, in JSONL, JSON or Parquet: tokenised with the model's
tokenizer and chat template, the loss on assistant (completion) tokens only, examples packed
into rows with per-example attention; the best checkpoint exported to OUTPUT_DIR/hf/ with
the tokenizer and generation config.
"""

import sys

from recipes.sft.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
