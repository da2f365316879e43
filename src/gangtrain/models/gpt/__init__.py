"""The native GPT (`recipes.lm`'s model), importable by any recipe: `model` (GPT, GPTConfig),
`spec` (GPT_SPEC: pipeline split, CP attention), `parallelize` (its TP plan)."""
