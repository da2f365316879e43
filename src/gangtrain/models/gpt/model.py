"""A small GPT for the ``lm`` recipe, laid out like torchtitan's Llama for parallelism plans.

Module names are part of the API (tensor-parallel plans are written against them)::

    tok_embeddings, pos_embeddings                  nn.Embedding
    layers[i].attention_norm, layers[i].ffn_norm    nn.LayerNorm
    layers[i].attention.{wq, wk, wv, wo}            nn.Linear (no bias)
    layers[i].feed_forward.{w1, w2}                 nn.Linear (no bias), GELU in between
    norm, output                                    nn.LayerNorm, nn.Linear (tied by default)

Attention derives its head count from the width of the local ``wq`` output, so column-wise sharding
of wq/wk/wv (and row-wise of wo) over a TP gang needs no change to the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from gangs import Gang
from gangtrain.layers.document_attention import document_attention
from gangtrain.layers.moe import GroupedExperts, MoEFeedForward
from gangtrain.parallel.context import ulysses_attention

__all__ = [
    "GPT",
    "Attention",
    "FeedForward",
    "GPTConfig",
    "TransformerBlock",
    "build_feed_forward",
    "flops_per_token",
    "num_parameters",
]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256  # the longest input; sizes the learned position table
    dim: int = 192
    num_layers: int = 4
    num_heads: int = 6
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    num_experts: int = 0  # > 0: mixture-of-experts feed-forward (see build_feed_forward)
    top_k: int = 2
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.num_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        for name in ("vocab_size", "seq_len", "dim", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return int(self.mlp_ratio * self.dim)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # A TP plan divides num_heads by the TP size; forward() does not rely on it.
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        # Context parallelism (`gangtrain.models.gpt.spec.GPTSpec.attend_over`): x is this rank's
        # slice of each row, and attention runs over the whole row through this group.
        self.cp_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` [b, t] of packed rows (restarting at 0 per example): attention
        stays within each example. Under context parallelism, this rank's slice's ids."""
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Heads from the local output width: under TP this rank holds only its share of the
        # heads (and weight.shape of a DTensor would be the global one). Not view(..., -1, ..)
        # so that an empty batch (b == 0) still reshapes.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if self.cp_group is not None:
            y = ulysses_attention(q, k, v, self.cp_group, position_ids=position_ids,
                                  dropout_p=dropout)
        else:  # within each document: a packed row costs the sum of its documents' squares
            y = document_attention(q, k, v, position_ids, dropout_p=dropout)
        return self.wo(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exact (erf) GELU: on this CPU it is 2x faster than the tanh approximation.
        return self.w2(F.gelu(self.w1(x)))


def build_feed_forward(config: GPTConfig, ep_gang: Gang | None = None) -> nn.Module:
    """The seam where a block's feed-forward is chosen: dense, or mixture of experts (its
    experts split over ``ep_gang``, every expert local when None)."""
    if config.num_experts > 0:
        return MoEFeedForward(
            config.dim, config.hidden_dim, config.num_experts, config.top_k, ep_gang,
            residual_std=0.02 / math.sqrt(2 * config.num_layers),  # as w2 in init_weights
        )
    return FeedForward(config)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``."""

    def __init__(self, config: GPTConfig, ep_gang: Gang | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.feed_forward = build_feed_forward(config, ep_gang)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), position_ids))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, ep_gang: Gang | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.seq_len, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(config, ep_gang) for _ in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections (wo, w2) scaled by 1/sqrt(2L), from the
        global RNG (see `init_parameter` for the same rule one parameter at a time)."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self._weight_std(name))
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor,
                       generator: torch.Generator | None = None) -> None:
        """Fill `tensor`, the FULL value of the parameter or buffer `name`, by the model's
        initialisation rule (the distributions of `init_weights` and of the MoE layers),
        drawing from `generator`: a `parallel.materialize.InitRule`, so a model built on
        the meta device starts from the same bits on every parallel layout."""
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, nn.LayerNorm):
            (nn.init.ones_ if leaf == "weight" else nn.init.zeros_)(tensor)
        elif isinstance(module, MoEFeedForward) and leaf == "tokens_per_expert":
            nn.init.zeros_(tensor)  # a counter, not a weight
        elif isinstance(module, GroupedExperts):  # w1 like any projection, w2 residual
            nn.init.normal_(tensor, std=self._weight_std(name), generator=generator)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and leaf == "weight":
            nn.init.normal_(tensor, std=self._weight_std(module_name), generator=generator)
        elif isinstance(module, nn.Linear) and leaf == "bias":
            nn.init.zeros_(tensor)
        else:
            raise ValueError(f"GPT has no initialisation rule for {name!r}")

    def _weight_std(self, module_name: str) -> float:
        """0.02, or 0.02 / sqrt(2 L) for the projections back into the residual stream."""
        if module_name.endswith((".wo", ".w2")):
            return 0.02 / math.sqrt(2 * self.config.num_layers)
        return 0.02

    def get_output_embeddings(self) -> nn.Linear:
        """The head (transformers' name for it, which `units.causal_lm` asks for)."""
        return self.output

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                logits_to_keep: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` [b, t] (t <= config.seq_len) -> logits [b, t, vocab_size].
        ``position_ids`` [b, t]: see `Attention.forward`. ``logits_to_keep`` [b, t] bool (as
        transformers takes it): the head runs at those positions only, and the logits are
        [kept, vocab_size] in row-major order (the loss needs no others)."""
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"input length {t} exceeds the model's seq_len {self.config.seq_len}")
        positions = (torch.arange(t, device=input_ids.device) if position_ids is None
                     else position_ids)
        h = self.dropout(self.tok_embeddings(input_ids) + self.pos_embeddings(positions))
        for layer in self.layers:
            h = layer(h, position_ids)
        if logits_to_keep is not None:
            h = h[logits_to_keep]
        return self.output(self.norm(h))


def num_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Distinct parameters (tied weights counted once; DTensors by their global size)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), for MFU: ``6 N + 12 L d T``.

    ``N`` counts the weights that take part in matrix products: the blocks' projections (the
    ``top_k`` active experts and the router when MoE) and the output layer; embedding
    lookups are free. The attention term (scores and weighted values, ``T = seq_len``) is not
    halved for causality, the PaLM / torchtitan convention.
    """
    d, hidden, layers = config.dim, config.hidden_dim, config.num_layers
    if config.num_experts > 0:
        ffn = config.top_k * 2 * d * hidden + d * config.num_experts
    else:
        ffn = 2 * d * hidden
    matmul_params = layers * (4 * d * d + ffn) + config.vocab_size * d
    return 6.0 * matmul_params + 12.0 * layers * d * config.seq_len
