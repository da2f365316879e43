"""gangtrain's own namespace: everything that is not the layout's `gangs`, `units`, `trainer`
or `recipes` lives here, so a user's own `data.py`, `models/` or `utils.py` shadows nothing.

- `gangtrain.data`: files -> batches (formats, chat templates, masks, packing, readers)
- `gangtrain.layers`: model layers apart from process groups (MoE, LoRA)
- `gangtrain.parallel`: the one build plan (meta -> TP/EP -> PP -> FSDP2/HSDP -> DDP)
- `gangtrain.models`: each model family's one home (its spec, HF in/out, the GPT)
- `gangtrain.app`: the recipes' application shell (config loading, cli, evaluate, hints)
"""
