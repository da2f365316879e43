"""What a user must see reaches the console: "resumed from step N", "early stop",
"checkpoint skipped", non-finite and stop-signal warnings; and only once, from rank 0.

The trainer logs them on the "gangtrain" logger. A user's own script often configures no
logging: records on a logger without a handler would vanish (INFO) or reach Python's
`logging.lastResort`, unformatted, on every rank, so a 2-rank run printed each warning
twice. So, unless the program configured logging itself (a handler on the logger or on the
root logger), rank 0 gives the logger a handler that prints to stderr and every other rank
a `NullHandler`: rank 0 alone speaks. The recipes configure logging on rank 0 only
(`configure_logging`).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "gangtrain"


def show_on_console(rank: int) -> None:
    """Make the "gangtrain" logger print INFO and above on rank 0 and nothing on the other
    ranks, unless logging is set up already (a handler on it or on the root logger)."""
    logger = logging.getLogger(LOGGER)
    if logger.hasHandlers():
        return
    if rank != 0:
        logger.addHandler(logging.NullHandler())  # keeps logging.lastResort quiet
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[gangtrain] %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def configure_logging() -> None:
    """A recipe's logging: INFO and above of every logger on stderr, on rank 0 only (the
    torchrun `RANK`); the other ranks keep gangtrain's lines to themselves."""
    if int(os.environ.get("RANK", "0")) == 0:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    else:
        show_on_console(int(os.environ["RANK"]))
