"""Tools that go wrong, for the fault tests (imported by path: 'agent_tools:boom')."""

from __future__ import annotations

import os
import time


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("kaboom")


def slow(x: float) -> float:
    """Sleeps.

    Args:
        x: Seconds.
    """
    time.sleep(x)
    return x


def chatty(n: int) -> str:
    """A long result.

    Args:
        n: Its length.
    """
    return "z" * n


def undocumented(x):  # no type hints, no docstring: no schema can be made
    return x


class Counter:
    """An environment (TRL's environment_factory): a counter the policy reads with a tool."""

    def reset(self, **row):
        self.value = len(row["prompt"][0]["content"])
        self.reads = 0
        return " (env ready)"

    def read(self) -> int:
        """Read the counter."""
        self.reads += 1
        return self.value

    def reward(self) -> float:
        return float(self.reads)


def forever(x: int) -> int:
    """Ignores any timeout: sleeps for good (only a killed process stops it).

    Args:
        x: Anything.
    """
    while True:
        time.sleep(3600)


def vanish(code: int) -> int:
    """Ends its own process at once.

    Args:
        code: The exit code.
    """
    os._exit(code)
