"""Hugging Face decoder families: each one's spec (`spec_for(model)`, a
`gangtrain.parallel.spec.ModelSpec`), and pretrained models in and out of gangtrain.

- `load_pretrained(path, gangs, ...)`: a local HF checkpoint directory built on meta,
  tensor-parallel by the model's own plan, sharded over DP, each rank reading its slices;
  with `lora=`, LoRA adapters on the frozen model.
- `export_pretrained(checkpoint, output_dir)`: a gangtrain checkpoint of a HF model written
  back as a HF directory, one tensor at a time (adapters merged into their base).
- `export_adapter(checkpoint, output_dir)`: a checkpoint's LoRA adapters in peft's format.
- `hf_model_of(model)`: the transformers model that `model` is or wraps (through DDP, FSDP2,
  `torch.compile`), else None.
- `HFModelFiles`: the trainer's files of a HF model (`step_N/hf/`, `OUT/hf/`): the default of
  every model `load_pretrained` returns (it carries them as `gangtrain_model_files`), or
  handed to the Trainer with the tokenizer as used (`gangtrain.posttrain`).

transformers is imported only when these are called.
"""

from gangtrain.models.hf.export import export_adapter, export_best_model, export_pretrained
from gangtrain.models.hf.load import load_pretrained
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.models.hf.spec import HFSpec, spec_for
from gangtrain.models.hf.trainer_files import HFModelFiles

__all__ = ["HFModelFiles", "HFSpec", "export_adapter", "export_best_model", "export_pretrained",
           "hf_model_of", "load_pretrained", "spec_for"]
