"""`PromptWindows`: the data reader of online RL. It deals prompts in generation windows
and yields one small descriptor per training micro-batch; the unit generates, scores and
splits a whole window when the first micro-batch of it arrives.

A window holds ``prompts_per_window`` prompts (shuffled each epoch, ``seed + epoch``, the
same order on every rank), i.e. ``window * batch_size`` completions; it is trained over
``window * num_iterations`` micro-batches. Each descriptor says which window (its number
counted from the start of the run), which micro-batch of it (``position``) and the window's
prompt indices. The position is O(1) state counted globally (``position_is_global``), so a
checkpoint taken inside a window resumes there, on any DP size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gangs.errors import UserError

__all__ = ["PromptWindows"]


class PromptWindows:
    position_is_global = True
    # Every rank gets the same descriptor on purpose: the unit takes this rank's share of
    # the window's completions (it needs the whole window's groups anyway).
    sharded_per_rank = True

    def __init__(self, num_prompts: int, prompts_per_window: int, micro_batches_per_window: int,
                 seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < prompts_per_window:
            raise UserError(f"data: {num_prompts} prompts are fewer than one generation window "
                            f"of {prompts_per_window} (generation.window x data.batch_size / "
                            "generation.num_generations)")
        self.num_prompts = num_prompts
        self.prompts_per_window = prompts_per_window
        self.micro_batches_per_window = micro_batches_per_window
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._window, self._position = 0, 0, 0

    @property
    def windows_per_epoch(self) -> int:
        return self.num_prompts // self.prompts_per_window

    def __len__(self) -> int:
        return self.windows_per_epoch * self.micro_batches_per_window

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_prompts)
        return torch.randperm(self.num_prompts,
                              generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self._order(self._epoch)
        while self._window < self.windows_per_epoch:
            start = self._window * self.prompts_per_window
            prompts = order[start:start + self.prompts_per_window].tolist()
            number = self._epoch * self.windows_per_epoch + self._window
            while self._position < self.micro_batches_per_window:
                item = {"window": number, "position": self._position, "prompts": prompts}
                self._position += 1  # counted before the yield: the micro-batch is consumed
                yield item
            self._window, self._position = self._window + 1, 0
        self._epoch, self._window = self._epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "window": self._window, "position": self._position,
                "num_prompts": self.num_prompts, "prompts_per_window": self.prompts_per_window}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (int(state.get("num_prompts", self.num_prompts)) != self.num_prompts
                or int(state.get("prompts_per_window", self.prompts_per_window))
                != self.prompts_per_window):
            raise UserError("the data position was saved over other prompts or another "
                            "window size: resume with the same data.files, data.batch_size, "
                            "generation.window and generation.num_generations, or start over "
                            "(--no-resume)")
        self._epoch, self._window = int(state["epoch"]), int(state["window"])
        self._position = int(state["position"])
