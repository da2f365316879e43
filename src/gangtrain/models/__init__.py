"""Model families, each in its one home: what the generic layers (`gangtrain.parallel`,
`trainer`) need to know of a model, as a `gangtrain.parallel.spec.ModelSpec` per family, and
the family's files in and out.

- `gangtrain.models.hf`: any Hugging Face decoder family, from its own config and class (its
  declared TP and PP plans, its attention interface), with a per-family entry only where one
  is needed; `load_pretrained`, `export_pretrained` and the files a HF checkpoint keeps.
- `gangtrain.models.gpt`: the native GPT of `recipes.lm` (model, spec, TP plan).

Sits above the trainer (it hands the trainer its `ModelFiles`); the trainer imports no family.
"""
