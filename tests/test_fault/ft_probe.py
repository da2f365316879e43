"""A callback for tests/test_fault/test_recipe_replica_groups.py, named in a recipe's config
(`trainer.callbacks`): it logs the rows each committed step trained, kills its process once
at a step, and slows a healthy group until the killed one is back."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from trainer import Callback


class StepRows(Callback):
    def __init__(self, out: str, replica_id: int = 0, kill_at: int | None = None,
                 hold_at: int | None = None) -> None:
        """`kill_at`: SIGKILL this process at the start of that step (once); `hold_at`: a
        healthy group, from that step on, waits for the killed group's restart."""
        self.out, self.replica_id = Path(out), replica_id
        self.kill_at, self.hold_at = kill_at, hold_at
        self.rows: list[str] = []

    def on_train_start(self, trainer: Any) -> None:
        if self.kill_at is not None and (self.out / "killed").exists():
            (self.out / "restarted").touch()  # before its first quorum

    def on_step_start(self, trainer: Any, batches: Any) -> None:
        self.rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:12]
                     for batch in batches for row in batch["input_ids"]]
        killed = self.out / "killed"
        if self.kill_at is not None and trainer.step_nr == self.kill_at and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Any) -> None:
        if trainer.replicas is None or trainer.replicas.committed:
            with (self.out / f"rows_{self.replica_id}_{os.getpid()}.jsonl").open("a") as f:
                f.write(json.dumps({"step": trainer.step_nr, "rows": self.rows}) + "\n")
        if self.hold_at is None or not (self.out / "killed").exists():
            return
        deadline = time.monotonic() + 240
        while trainer.step_nr >= self.hold_at and not (self.out / "restarted").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the killed group was not restarted")
            time.sleep(0.05)  # trained on without it; now it must be able to rejoin
