"""Online RL (GRPO, Dr. GRPO, DAPO, RLOO) of a local Hugging Face causal LM on prompts scored
by reward functions."""
