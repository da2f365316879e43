"""Model layers that know nothing of how a model is trained or wrapped; adapters (LoRA:
`layers.lora`)."""
