"""Show the library's warnings on stderr while ``maintain`` runs, one line each.

The library installs no logging handlers; a host decides where its logs go. ``maintain`` is
that host, and an operator running it must see a lost claim, a failing handler or an
overrunning pass as it happens: one line per record, the exception as its type and message,
passwords masked. ``WEFT_SYNC_DEBUG=1`` adds the exception's traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, TextIO

from ...redaction import redact_text
from .output import one_line

LIBRARY_LOGGER: Final = "weft_sync"


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"weft-sync: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            text += f" ({type(error).__name__}: {error})"
            if os.environ.get("WEFT_SYNC_DEBUG"):
                return one_line(text) + "\n" + redact_text(self.formatException(record.exc_info))
        return one_line(text)


@contextmanager
def warnings_to_stderr(stream: TextIO | None = None) -> Iterator[None]:
    """Inside the block, write the library's WARNING and worse records to ``stream`` (stderr)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_OneLine())
    logger = logging.getLogger(LIBRARY_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
