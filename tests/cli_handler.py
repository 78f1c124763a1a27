"""A ``weft-sync maintain --handler tests.cli_handler:resume`` target for the CLI tests.

The CLI calls the handler with the id of each workflow it reclaimed. This one records the id in
:data:`RESUMED` (read by in-process tests) and prints ``resumed <id>`` (read from a subprocess's
stdout).
"""

from __future__ import annotations

import threading

__all__ = ["NOT_CALLABLE", "RESUMED", "resume", "take_resumed"]

# _lock guards RESUMED: the CLI calls the handler from maintenance worker threads.
_lock = threading.Lock()
RESUMED: list[str] = []

NOT_CALLABLE = "a handler spec naming this attribute is refused"


def resume(workflow_id: str) -> None:
    """Record that the maintenance pass handed ``workflow_id`` to this process to drive."""
    with _lock:
        RESUMED.append(workflow_id)
    print(f"resumed {workflow_id}", flush=True)


def take_resumed() -> list[str]:
    """The ids recorded since the last call, oldest first; the record is emptied."""
    with _lock:
        taken = list(RESUMED)
        RESUMED.clear()
    return taken
