"""The anti-thrash takeover cooldown: a fixed window after this engine lost a claim."""

from __future__ import annotations

import threading


class TakeoverCooldown:
    """Per-workflow windows during which this engine does not try to take a claim back.

    In memory and per engine; a restart forgets it. A new deposition restarts the window from the
    new time rather than extending it.

    :param window_ms: the window length (the claim renew interval).
    """

    def __init__(self, window_ms: int) -> None:
        if isinstance(window_ms, bool) or not isinstance(window_ms, int) or window_ms < 0:
            raise ValueError(f"cooldown window_ms must be an int >= 0, got {window_ms!r}")
        self._window_ms = window_ms
        # _lock guards _until.
        self._lock = threading.Lock()
        self._until: dict[str, int] = {}

    @property
    def window_ms(self) -> int:
        return self._window_ms

    def record_deposition(self, workflow_id: str, now: int) -> None:
        """Start (or restart) the window for ``workflow_id`` at ``now``."""
        with self._lock:
            self._until[workflow_id] = now + self._window_ms

    def is_active(self, workflow_id: str, now: int) -> bool:
        """Whether ``now`` is inside the window (the end instant is outside)."""
        with self._lock:
            until = self._until.get(workflow_id)
        return until is not None and now < until

    def clear(self, workflow_id: str) -> None:
        """End the window for ``workflow_id``; a no-op for an unknown id."""
        with self._lock:
            self._until.pop(workflow_id, None)
