"""Pretrained Hugging Face models in and out of gangtrain.

- `load_pretrained(path, gangs, ...)`: a local HF checkpoint directory built on meta,
  tensor-parallel by the model's own plan, sharded over DP, each rank reading its slices.
- `export_pretrained(checkpoint, output_dir)`: a gangtrain checkpoint of a HF model written
  back as a HF directory, one tensor at a time.

transformers is imported only when these are called.
"""

from trainer.hf.export import export_best_model, export_pretrained
from trainer.hf.load import load_pretrained

__all__ = ["export_best_model", "export_pretrained", "load_pretrained"]
