"""What a user must see reaches the console: "resumed from step N", "early stop",
"checkpoint skipped", non-finite and stop-signal warnings.

The trainer logs them on the "gangtrain" logger. A recipe configures logging itself; a
user's own script often configures none, and records on a logger without a handler would
vanish (INFO) or lose their format. So, on rank 0, when no handler would take them, the
trainer gives the logger one that prints to stderr.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "gangtrain"


def show_on_console(rank: int) -> None:
    """Make the "gangtrain" logger print INFO and above on rank 0 unless logging is set up
    already (a handler on it or on the root logger)."""
    logger = logging.getLogger(LOGGER)
    if rank != 0 or logger.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[gangtrain] %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
