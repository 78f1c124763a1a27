"""``weft-sync`` / ``python -m weft_sync``: the command line over the public API."""

from __future__ import annotations

from .app import (
    DEFAULT_URL,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    main,
)

__all__ = [
    "DEFAULT_URL",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
]
