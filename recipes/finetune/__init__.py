"""Fine-tune a local Hugging Face causal LM on your own text or JSONL files."""
