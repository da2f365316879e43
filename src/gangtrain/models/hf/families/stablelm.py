"""StableLM (`model_type` "stablelm", transformers' `StableLmForCausalLM`): a LLaMA-like decoder
(LayerNorms, partial rotary embeddings) whose config declares neither a tensor-parallel plan
nor a pipeline layout, and whose attention reshapes by its own head count
(`view(b, t, self.num_heads, head_dim)`), which must be this TP rank's.

This file is the whole family: `spec_for` finds it (`models.hf.families`), and every recipe
that loads a HF model (`load_pretrained`, `load_layout`) then trains StableLM under TP (the
Megatron split LLaMA declares: q/k/v and gate/up column-wise, o and down row-wise, the output
layer split by vocabulary and gathered), PP (its embedding, layers and final norm, as LLaMA's
`base_model_pp_plan` names them) and CP (its attention goes through transformers' attention
interface, which `attend_over` replaces).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gangs import Gangs
from gangs.errors import UserError
from gangtrain.models.hf.spec import HFSpec

__all__ = ["SPECS", "StableLMSpec"]

_LAYER_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class StableLMSpec(HFSpec):
    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        prefix = model.base_model_prefix
        return {**{f"{prefix}.{pattern}": style for pattern, style in _LAYER_PLAN.items()},
                "lm_head": "colwise_gather_output"}

    def pp_plan(self, model: nn.Module) -> dict[str, Any]:
        return {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"])}

    def tensor_parallel(self, model: nn.Module, gangs: Gangs) -> None:
        tp = gangs.tp.size
        if tp > 1 and getattr(model.config, "qk_layernorm", False):
            raise UserError(f"{self.name}: qk_layernorm (one LayerNorm per head, in "
                            "config.json) is not split over tensor-parallel ranks; train it "
                            "with gangs.tp_size 1")
        super().tensor_parallel(model, gangs)
        if tp == 1:
            return
        # Each rank's q/k/v projections now give it 1/tp of the heads: the attention's
        # reshape must count those (the key/value groups per query head stay the same).
        for module in model.modules():
            if type(module).__name__ == "StableLmAttention":
                module.num_heads //= tp
                module.num_key_value_heads //= tp


SPECS = {"stablelm": StableLMSpec}
