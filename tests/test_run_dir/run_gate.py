"""A callback that holds a recipe run at one step until the test lets it go, so another
command can be tried while the run is certainly alive (``run_gate:WaitAtStep``)."""

from __future__ import annotations

import time
from pathlib import Path

from trainer.observe.callbacks import Callback


class WaitAtStep(Callback):
    """At the end of step `step`: write `<gate>.reached`, then wait until `gate` exists
    (at most `timeout_s`). Changes nothing in the training itself."""

    def __init__(self, step: int, gate: str, timeout_s: float = 240.0) -> None:
        self.step, self.gate, self.timeout_s = step, Path(gate), timeout_s

    def on_step_end(self, trainer) -> None:
        if trainer.step_nr != self.step:
            return
        Path(f"{self.gate}.reached").write_text(str(self.step))
        deadline = time.monotonic() + self.timeout_s
        while not self.gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} never opened")
            time.sleep(0.05)
