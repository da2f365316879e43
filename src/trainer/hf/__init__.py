"""Pretrained Hugging Face models in and out of gangtrain.

- `load_pretrained(path, gangs, ...)`: a local HF checkpoint directory built on meta,
  tensor-parallel by the model's own plan, sharded over DP, each rank reading its slices;
  with `lora=`, LoRA adapters on the frozen model.
- `export_pretrained(checkpoint, output_dir)`: a gangtrain checkpoint of a HF model written
  back as a HF directory, one tensor at a time (adapters merged into their base).
- `export_adapter(checkpoint, output_dir)`: a checkpoint's LoRA adapters in peft's format.
- `hf_model_of(model)`: the transformers model that `model` is or wraps (through DDP, FSDP2,
  `torch.compile`), else None.

transformers is imported only when these are called.
"""

from trainer.checkpoint.model_files import hf_model_of
from trainer.hf.export import export_adapter, export_best_model, export_pretrained
from trainer.hf.load import load_pretrained

__all__ = ["export_adapter", "export_best_model", "export_pretrained", "hf_model_of",
           "load_pretrained"]
