"""A HF model's model-only saves are HF directories: `from_pretrained` gives the model of
that step, logits bit for bit. A model built by transformers itself (not `load_pretrained`,
whose models carry their files) is handed its files: `Trainer(model_files=HFModelFiles())`."""

from __future__ import annotations

import torch
from hf_models import TRAIN, SampleReader, tiny_gpt2
from transformers import GPT2LMHeadModel

from gangtrain.models.hf import HFModelFiles
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit


def test_model_only_saves_of_a_hf_model_load_with_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2()  # lm_head tied to the embedding
    Trainer(CausalLMUnit(model), SampleReader(TRAIN, 8, 0, 1),
            torch.optim.AdamW(model.parameters(), lr=1e-2), output_dir=tmp_path,
            max_num_steps=4, model_checkpoint_every_n_steps=2, recorders=[],
            model_files=HFModelFiles()).run()
    step_dir = tmp_path / "models" / "step_4"
    assert (step_dir / "config.json").is_file() and (step_dir / "model.safetensors").is_file()
    loaded = GPT2LMHeadModel.from_pretrained(step_dir).eval()
    model.eval()
    ids = TRAIN["input_ids"][:4]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
