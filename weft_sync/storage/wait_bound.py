"""A deadline past which a store stops waiting for locks other connections hold.

``Ownership.close(timeout)`` sets it so that the pass in flight, the final releases and the
store's own shutdown all end by one deadline, whatever a foreign writer does. A call that would
have to wait past it fails with :class:`~weft_sync.errors.StorageError` and writes nothing; a
call that finds no lock held still runs, so a close whose passes overran its timeout still
releases what it can.
"""

from __future__ import annotations

import math
import threading
from typing import Protocol, runtime_checkable


class WaitDeadline:
    """The current bound: a ``time.monotonic()`` reading, or none. Safe to use from any thread."""

    def __init__(self) -> None:
        # Guards _deadline.
        self._lock = threading.Lock()
        self._deadline = math.inf

    def set(self, deadline: float | None) -> None:
        """Bound waits at ``deadline`` (an earlier bound already set stays); ``None`` lifts it."""
        with self._lock:
            self._deadline = math.inf if deadline is None else min(self._deadline, deadline)

    def limit(self, natural: float) -> float:
        """Return when a wait that would end at ``natural`` (monotonic) ends now."""
        with self._lock:
            return min(natural, self._deadline)

    @property
    def deadline(self) -> float:
        """The bound; ``math.inf`` when none is set."""
        with self._lock:
            return self._deadline

    def cuts(self, natural: float) -> bool:
        """Whether the bound ends a wait before ``natural``."""
        with self._lock:
            return self._deadline < natural


@runtime_checkable
class SupportsWaitBound(Protocol):
    """A store whose lock waits, and whose ``close()``, can be bounded by a deadline."""

    def bound_waits(self, deadline: float | None) -> None:
        """End every wait for a lock held by another connection at ``deadline`` at the latest.

        ``close()`` then waits for the work in flight until the deadline and a short grace at
        most; what still runs is left behind (and logged), never waited for.

        :param deadline: a ``time.monotonic()`` reading; ``None`` lifts the bound. An earlier
            bound stays until lifted. Waits already running are cut too.
        """
