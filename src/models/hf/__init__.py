"""Hugging Face decoder families as `parallel.spec.ModelSpec`s: `spec_for(model)`.

transformers is imported only when a spec is used."""

from models.hf.spec import HFSpec, spec_for

__all__ = ["HFSpec", "spec_for"]
