"""`ImageGenerator`: `HFGenerator` for prompts with images. Each prompt comes with its model
inputs beside the ids (a vision-language model's `pixel_values`, from
`data.vision_prompts.ImagePromptSet.model_inputs`), which the engine passes to the row's
prefill (`gangtrain.rl.engine.Request.inputs`); decoding then reads the cache alone, as for
text. Sampling, seeds and log-probabilities are `HFGenerator`'s.

A completion that samples an image placeholder token (a model early in training may) ends
before it, truncated: the trained forward would look for that image's pixels. The tokens
kept are what was sampled, with the log-probabilities it was sampled with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from gangtrain.rl.engine import Request
from gangtrain.rl.generation import Completion, HFGenerator

__all__ = ["ImageGenerator"]


class ImageGenerator(HFGenerator):
    """`HFGenerator` (its keywords) with ``placeholder_ids``: the image tokens a completion
    is cut before."""

    def __init__(self, model: nn.Module, *, placeholder_ids: Sequence[int] = (),
                 **settings: Any) -> None:
        super().__init__(model, **settings)
        self.placeholder_ids = frozenset(int(i) for i in placeholder_ids)

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 inputs: Sequence[dict[str, Tensor]] | None = None) -> list[Completion]:
        """One completion per prompt, the i-th sampled with ``seeds[i]`` and prefilled with
        ``inputs[i]`` (None: text prompts, `HFGenerator.generate`). A completion is cut before
        a placeholder whatever its prompt holds: a batch of text prompts alike."""
        if inputs is None:
            return [self._cut(c) for c in super().generate(prompts, seeds)]
        requests = [Request(list(p), int(s), self.max_new_tokens, inputs=dict(extra) or None)
                    for p, s, extra in zip(prompts, seeds, inputs, strict=True)]
        capacity = max((len(p) for p in prompts), default=1) + self.max_new_tokens + 1
        done = self.engine.run(requests, capacity=capacity)
        return [self._cut(Completion(tuple(r.turns[0].ids), tuple(r.turns[0].logprobs),
                                     r.turns[0].truncated)) for r in done]

    def _cut(self, c: Completion) -> Completion:
        at = next((i for i, t in enumerate(c.ids) if t in self.placeholder_ids), None)
        return c if at is None else Completion(c.ids[:at], c.logprobs[:at], truncated=True)
