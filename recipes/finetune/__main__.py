"""`python -m recipes.finetune OUTPUT_DIR --set model.path=DIR --set 'data.files=[...]'`

Fine-tunes a local Hugging Face causal LM (a directory with config.json, safetensors weights
and tokenizer files) on text files or JSONL files (a `text` field), with its own tokenizer,
and exports the best checkpoint as a Hugging Face directory in OUTPUT_DIR/hf/.
"""

import sys

from recipes.finetune.config import PRESETS, RESUME_GUARD, FinetuneConfig
from recipes.finetune.recipe import eval_main, main
from trainer.cli import run_recipe

if __name__ == "__main__":
    sys.exit(run_recipe(FinetuneConfig, PRESETS, main, prog="python -m recipes.finetune",
                        default_preset="default", resume_guard=RESUME_GUARD,
                        eval_main=eval_main))
