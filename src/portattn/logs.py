"""The ``portattn`` logger's default output.

As vLLM does, the start-up lines (device, dtype, KV-cache size, backends) are shown at INFO without
any set-up: the first :class:`~portattn.LLM` gives the ``portattn`` logger a handler on standard
error at INFO, unless the program has set logging up itself (a handler on the root logger or on
``portattn``, or a level on ``portattn``) or ``PORTATTN_CONFIGURE_LOGGING=0``.
"""

from __future__ import annotations

import logging
import os


def configure_default_logging() -> None:
    """Give the ``portattn`` logger its default handler, once, where nobody configured logging."""
    if os.environ.get("PORTATTN_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("portattn")
    if logger.handlers or logger.level != logging.NOTSET or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # as the command line prints them
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler added later would print every line twice
