"""`python -m recipes.finetune OUTPUT_DIR --set model.path=DIR --set 'data.files=[...]'`

Fine-tunes a local Hugging Face causal LM (a directory with config.json, safetensors weights
and tokenizer files) on text files or JSONL files (a `text` field), with its own tokenizer,
and exports the best checkpoint as a Hugging Face directory in OUTPUT_DIR/hf/.
"""

import sys

from recipes.finetune.recipe import cli

if __name__ == "__main__":
    sys.exit(cli())
