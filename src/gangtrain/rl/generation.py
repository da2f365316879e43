"""Generation behind one small interface, `Generator`: prompts (token ids) and one sampling
seed per completion in, completions (token ids, the generator's log-probability of each
sampled token, whether it was cut at ``max_new_tokens``) out.

`HFGenerator` samples with the policy itself: a Hugging Face causal LM, prompts left-padded,
a KV cache (`transformers.DynamicCache`), one token a forward. Each completion draws its own
noise from a `torch.Generator` seeded with its seed (`sample_seed`: a function of the run's
seed, the generation window, the prompt and the sample index), so a completion does not
depend on which rank or batch generates it, nor on the process RNG. Under FSDP2 (``gang``
given) every rank keeps stepping until all ranks' completions have stopped: a forward is a
collective there, and ranks finishing at different lengths must not hang.

A vLLM or SGLang server would implement the same `Generator` (weights pushed to it after
each optimizer step, its log-probabilities returned per token); not built here.

Log-probabilities are those of the sampling distribution before top-p: ``log_softmax(logits
/ temperature)``, what the trained forward computes (TRL divides its logits likewise).
Temperature 0 means greedy decoding (validation).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gangs import Gang, ReduceOperation
from gangtrain.layers.wrappers import unwrapped

__all__ = ["Completion", "Generator", "HFGenerator", "sample_seed"]


@dataclass(frozen=True)
class Completion:
    ids: tuple[int, ...]
    """The sampled tokens, the stop token included when it stopped."""
    logprobs: tuple[float, ...]
    truncated: bool
    """Cut at max_new_tokens without a stop token."""


class Generator(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
                 ) -> list[Completion]:
        """One completion per prompt, the i-th sampled with ``seeds[i]``."""
        ...


def sample_seed(seed: int, window: int, prompt_index: int, sample_index: int) -> int:
    """A completion's sampling seed: the same wherever it is generated."""
    key = f"{seed}/{window}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Logits with the tokens outside the smallest set of probability >= top_p at -inf."""
    ordered, order = logits.sort(-1, descending=True)
    cumulative = ordered.softmax(-1).cumsum(-1)
    drop = cumulative - ordered.softmax(-1) >= top_p  # the mass before a token already enough
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)


class HFGenerator:
    """Samples from ``model`` (see the module docstring). ``stop_ids``: the tokens that end
    a completion; ``pad_id`` fills rows that stopped; ``gang``: the FSDP2 gang whose ranks
    step together (None: no collective in a forward)."""

    def __init__(self, model: nn.Module, *, stop_ids: Sequence[int], pad_id: int,
                 max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 gang: Gang | None = None) -> None:
        self.model = model
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.gang = gang

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
                 ) -> list[Completion]:
        from transformers import DynamicCache

        model = unwrapped(self.model)  # DDP's wrapper would prepare a backward per call
        was_training = model.training
        model.eval()
        try:
            return self._generate(model, prompts, seeds, DynamicCache())
        finally:
            model.train(was_training)

    def _generate(self, model: nn.Module, prompts: Sequence[Sequence[int]],
                  seeds: Sequence[int], cache: Any) -> list[Completion]:
        device = next(model.parameters()).device
        rows, width = len(prompts), max((len(p) for p in prompts), default=1)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends at `width`
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        stop_ids = self.stop_ids.to(device)
        tokens: list[Tensor] = []
        logprobs: list[Tensor] = []
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        inputs, step_positions = ids, positions
        # transformers 5 renamed the cache keyword (`past_key_values` warns there)
        cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"
        for _ in range(self.max_new_tokens):
            out = model(input_ids=inputs, attention_mask=mask, position_ids=step_positions,
                        use_cache=True, logits_to_keep=1, **{cache_keyword: cache})
            cache = getattr(out, cache_keyword, None) or out.past_key_values
            logits = out.logits[:, -1].float()
            token, logp = self._sample(logits, generators)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(logp)
            done = done | torch.isin(token, stop_ids)
            if self._all_done(done):
                break
            inputs = token[:, None]
            step_positions = step_positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], 1)
        return self._completions(tokens, logprobs, stop_ids)

    def _sample(self, logits: Tensor, generators: list[torch.Generator]
                ) -> tuple[Tensor, Tensor]:
        """(a token per row, its log-probability under the temperature-scaled logits)."""
        if self.temperature == 0:
            token = logits.argmax(-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
        scaled = logits / self.temperature
        logp = scaled.log_softmax(-1)
        filtered = _top_p_filter(scaled, self.top_p) if self.top_p < 1 else scaled
        # Gumbel-max with each row's own noise: argmax(logits + g) samples softmax(logits).
        noise = torch.stack([torch.rand(logits.shape[-1], generator=g, dtype=torch.float64)
                             for g in generators]).to(logits.device)
        gumbel = -torch.log(-torch.log(noise.clamp(min=1e-300)))
        token = (filtered.double() + gumbel).argmax(-1)
        return token, logp.gather(-1, token[:, None])[:, 0]

    def _all_done(self, done: Tensor) -> bool:
        left = (~done).sum().to(torch.float64).reshape(1)
        if self.gang is not None and self.gang.size > 1:
            self.gang.all_reduce(left, ReduceOperation.SUM)
        return bool(left.item() == 0)

    def _completions(self, tokens: list[Tensor], logprobs: list[Tensor], stop_ids: Tensor
                     ) -> list[Completion]:
        if not tokens:
            return []
        token_rows = torch.stack(tokens, 1).cpu().tolist()
        logp_rows = torch.stack(logprobs, 1).cpu().tolist()
        stops = set(stop_ids.cpu().tolist())
        out = []
        for ids, logps in zip(token_rows, logp_rows, strict=True):
            end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
            n = end if end is not None else min(len(ids), self.max_new_tokens)
            out.append(Completion(tuple(ids[:n]), tuple(logps[:n]), truncated=end is None))
        return out
