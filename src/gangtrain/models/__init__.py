"""Model families: what the generic layers (`parallel`, `trainer`) need to know of a model,
as a `parallel.spec.ModelSpec` per family.

- `models.hf`: any Hugging Face decoder family, from its own config and class (its declared
  TP and PP plans, its attention interface), with a per-family entry only where one is
  needed.

The LM recipe's GPT brings its spec from `gangtrain.models.gpt.spec`. Imports `gangs`, `layers` and
`parallel` only."""
