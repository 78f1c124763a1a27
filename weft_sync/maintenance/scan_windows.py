"""Rotating scan windows: bounded reads that still cover a whole key range over several passes.

A :class:`RotatingWindow` reads at most ``limit`` keys under one prefix per call, starting after
the last key the previous call read, and wraps to the start of the prefix once a call comes back
short. Every key present for a whole cycle is therefore read within ``ceil(N / limit) + 1``
calls, whatever ``N`` is, while each call costs one bounded range read.

Each window belongs to one reader (one engine's discovery); its cursor is guarded by the window's
own lock and lives only in memory.
"""

from __future__ import annotations

import threading

from ..storage.base import Storage

__all__ = ["RotatingWindow"]


class RotatingWindow:
    """A bounded, rotating read over the keys under ``prefix``.

    :param prefix: the key prefix to cover.
    :param limit: the most rows one :meth:`read` returns (``>= 1``).
    :raises ValueError: ``limit`` is not a whole number ``>= 1``.
    """

    def __init__(self, prefix: str, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"a scan window's limit must be a whole number >= 1, got {limit!r}")
        self.prefix = prefix
        self.limit = limit
        # _lock guards _cursor: the last key the previous read returned, None at the start.
        self._lock = threading.Lock()
        self._cursor: str | None = None

    def read(self, storage: Storage) -> list[tuple[str, bytes]]:
        """Read the next window; a short window (the end reached) restarts the next one.

        :raises StorageError: the scan failed (the cursor does not move then).
        """
        with self._lock:
            cursor = self._cursor
        rows = storage.scan(self.prefix, gt=cursor, limit=self.limit)
        with self._lock:
            self._cursor = rows[-1][0] if len(rows) >= self.limit else None
        return rows

    def passes_to_cover(self, keys: int) -> int:
        """The reads after which every one of ``keys`` present throughout has been read."""
        return -(-max(keys, 0) // self.limit) + 1
