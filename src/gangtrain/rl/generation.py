"""Generation behind one small interface, `Generator`: prompts (token ids) and one sampling
seed per completion in, completions (token ids, the generator's log-probability of each
sampled token, whether it was cut at ``max_new_tokens``) out.

`HFGenerator` samples with the policy itself, a Hugging Face causal LM, through
`gangtrain.rl.engine.Engine`: a preallocated slot KV cache, continuous batching with a host
read every few tokens, chunked prefill. Each completion's noise is a counter-based function of
its seed (`sample_seed`: a function of the run's seed, the generation window, the prompt and
the sample index) and the token's position (`gangtrain.rl.sampling`), so a completion does not
depend on which rank, batch or slot generates it, nor on the process RNG. Under FSDP2
(``gang`` given) every rank does the same forwards until all ranks' completions have stopped:
a forward is a collective there, and ranks finishing at different lengths must not hang.

``generation.engine: vllm`` (a colocated vLLM behind the same seam) is refused by name where
vLLM or a GPU is missing; the vLLM path itself is not built yet.

Log-probabilities are those of the sampling distribution before top-p: ``log_softmax(logits
/ temperature)``, what the trained forward computes (TRL divides its logits likewise).
Temperature 0 means greedy decoding (validation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from gangs import Gang
from gangtrain.layers.wrappers import unwrapped
from gangtrain.rl.engine import Engine, Request

__all__ = ["Completion", "Generator", "HFGenerator", "sample_seed"]


@dataclass(frozen=True)
class Completion:
    ids: tuple[int, ...]
    """The sampled tokens, the stop token included when it stopped."""
    logprobs: tuple[float, ...]
    truncated: bool
    """Cut at max_new_tokens without a stop token (multi-turn: the budget ran out in a
    turn, or the context would not fit)."""
    mask: tuple[int, ...] | None = None
    """Multi-turn: 1 where the policy sampled the token, 0 where it is context it did not
    sample (tool results, the template's turn markers; their log-probs are 0.0). None: every
    token sampled."""
    prompt_ids: tuple[int, ...] | None = None
    """Multi-turn: the context before the first sampled token when it is not the prompt
    set's (the tools' schemas rendered in it, an environment's first observation)."""
    messages: tuple[dict[str, Any], ...] | None = None
    """Multi-turn: the turns after the prompt as messages (calls and results)."""
    tool_calls: int = 0
    tool_failures: int = 0

    @property
    def sampled(self) -> int:
        """The tokens the policy sampled: the trajectory's length."""
        return len(self.ids) if self.mask is None else sum(self.mask)


class Generator(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
                 ) -> list[Completion]:
        """One completion per prompt, the i-th sampled with ``seeds[i]``."""
        ...


def sample_seed(seed: int, window: int, prompt_index: int, sample_index: int) -> int:
    """A completion's sampling seed: the same wherever it is generated."""
    key = f"{seed}/{window}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class HFGenerator:
    """Samples from ``model`` (see the module docstring). ``stop_ids``: the tokens that end
    a completion; ``pad_id`` fills unused prefill columns; ``gang``: the FSDP2 gang whose
    ranks step together (None: no collective in a forward). ``max_batch``, ``sync_every``,
    ``prefill_chunk``: the engine's slots, decode steps between host reads (None: the
    device's, `engine.default_sync_every`), prefill chunk."""

    def __init__(self, model: nn.Module, *, stop_ids: Sequence[int], pad_id: int,
                 max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 gang: Gang | None = None, max_batch: int = 32, sync_every: int | None = None,
                 prefill_chunk: int = 512) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        # DDP's wrapper would prepare a backward per call: the engine runs the module inside
        self.engine = Engine(unwrapped(model), stop_ids=stop_ids, pad_id=pad_id,
                             temperature=temperature, top_p=top_p, max_batch=max_batch,
                             sync_every=sync_every, prefill_chunk=prefill_chunk, gang=gang)

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
                 ) -> list[Completion]:
        requests = [Request(list(p), int(s), self.max_new_tokens)
                    for p, s in zip(prompts, seeds, strict=True)]
        # every prompt, its whole budget and the token sampled last (never fed)
        capacity = max((len(p) for p in prompts), default=1) + self.max_new_tokens + 1
        done = self.engine.run(requests, capacity=capacity)
        return [Completion(tuple(r.turns[0].ids), tuple(r.turns[0].logprobs),
                           r.turns[0].truncated) for r in done]
