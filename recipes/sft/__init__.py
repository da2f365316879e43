"""Supervised fine-tuning of a local Hugging Face causal LM on chat or instruction data."""
