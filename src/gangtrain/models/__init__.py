"""Model families, each in one home with its `parallel.spec.ModelSpec` (build, TP plan,
pipeline split, CP attention, experts, layout refusals, LoRA targets, export):

- `gangtrain.models.hf`: any Hugging Face decoder family, from its own config and class (its
  declared TP and PP plans, its attention interface); a family that declares too little
  gets one file under `gangtrain.models.hf.families`.
- `gangtrain.models.gpt`: the native GPT (model, spec, TP plan, build), any recipe's to use.

Above the trainer: the trainer imports nothing of this package."""
