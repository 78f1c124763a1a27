"""A bound set with ``bound_waits`` ends a real lock wait within seconds, not at the busy timeout.

The store's busy timeout is ten minutes, far past the test's own guard: a wait the bound did not
cut is reported by the guard after a few seconds, not by the suite's global timeout.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from weft_sync.errors import StorageError
from weft_sync.storage import SqliteStorage

BUSY_TIMEOUT_MS = 600_000
BOUND_S = 0.3
GUARD_S = 8.0


def test_a_write_waiting_for_a_foreign_lock_ends_at_the_bound_within_seconds(
    tmp_path: Path,
) -> None:
    db_path = tmp_path / "store.db"
    with SqliteStorage(db_path, table="kv", busy_timeout_ms=BUSY_TIMEOUT_MS) as store:
        store.put("k", b"v0")
        outcome: list[BaseException | None] = []
        elapsed: list[float] = []

        def blocked_put() -> None:
            start = time.monotonic()
            try:
                store.put("k", b"v1")
                outcome.append(None)
            except BaseException as exc:  # judged by the test thread
                outcome.append(exc)
            elapsed.append(time.monotonic() - start)

        foreign = sqlite3.connect(db_path, isolation_level=None)
        try:
            foreign.execute("BEGIN IMMEDIATE")
            store.bound_waits(time.monotonic() + BOUND_S)
            worker = threading.Thread(target=blocked_put, name="blocked-put", daemon=True)
            worker.start()
            worker.join(GUARD_S)
            still_blocked = worker.is_alive()
            foreign.execute("ROLLBACK")  # a wait the bound did not cut ends now, no thread leaks
        finally:
            foreign.close()
        worker.join(GUARD_S)
        assert not worker.is_alive()
        assert not still_blocked, f"the put still waited after {GUARD_S} s: the bound was ignored"
        (error,) = outcome
        assert isinstance(error, StorageError), error
        assert "gave up at the close deadline" in str(error)
        assert elapsed[0] < BOUND_S + 5.0, elapsed
        store.bound_waits(None)
        assert store.get("k") == b"v0"
