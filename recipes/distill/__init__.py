"""On-policy distillation of a local Hugging Face causal LM (the student) from a teacher of
the same vocabulary."""
