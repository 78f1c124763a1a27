"""Rotating scan windows: bounded reads that still cover a whole key range over several passes.

A :class:`RotatingWindow` reads at most ``limit`` keys under one prefix per call, starting after
the last key the previous call read, and wraps to the start of the prefix once a call comes back
short. Every key present for a whole cycle is therefore read within ``ceil(N / limit) + 1``
calls, whatever ``N`` is, while each call costs one bounded range read.

Each window belongs to one reader (one engine's discovery); its cursor is guarded by the window's
own lock and lives only in memory. :func:`read_windows` reads several windows together, in one
statement where the store can (:func:`~weft_sync.storage.reads.storage_scan_many`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..storage.base import Storage
from ..storage.reads import ScanRange, storage_scan_many


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
        (rows,) = read_windows(storage, [self])
        return rows

    def _next_range(self) -> ScanRange:
        with self._lock:
            return ScanRange(self.prefix, gt=self._cursor, limit=self.limit)

    def _advance(self, rows: list[tuple[str, bytes]]) -> None:
        with self._lock:
            self._cursor = rows[-1][0] if len(rows) >= self.limit else None

    def passes_to_cover(self, keys: int) -> int:
        """The reads after which every one of ``keys`` present throughout has been read."""
        return -(-max(keys, 0) // self.limit) + 1


def read_windows(
    storage: Storage, windows: Sequence[RotatingWindow], *, also: Sequence[ScanRange] = ()
) -> list[list[tuple[str, bytes]]]:
    """Read the next window of each of ``windows``, and the scans ``also``, together.

    One statement where the store can. Returns the windows' rows, then those of ``also``.

    :raises StorageError: the scan failed (no cursor moves then).
    """
    ranges = [window._next_range() for window in windows]
    rows = storage_scan_many(storage, [*ranges, *also])
    for window, read in zip(windows, rows, strict=False):
        window._advance(read)
    return rows
