"""A clock wrapper for tests of host clocks that fail: it raises while a test says so."""

from __future__ import annotations

import threading

from weft_sync.clock import Clock


class SwitchedClock:
    """``inner``, made to raise ``error`` on every read while one is set (:meth:`fail_with`)."""

    def __init__(self, inner: Clock) -> None:
        self._inner = inner
        # _lock guards _error.
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def fail_with(self, error: BaseException | None) -> None:
        """Raise ``error`` on every read from now on; ``None`` reads ``inner`` again."""
        with self._lock:
            self._error = error

    def __call__(self) -> int:
        with self._lock:
            error = self._error
        if error is not None:
            raise error
        return self._inner()
