"""One file per Hugging Face family that transformers does not describe enough for gangtrain
(no declared TP or PP plan, other LoRA targets, a forward that must be told its local heads):
an `HFSpec` subclass and `SPECS = {model_type: that class}`. `models.hf.spec.spec_for` finds
every module here; adding a family is adding its file."""
