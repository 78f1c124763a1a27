"""SqliteStorage ends its lock waits at a bound: a foreign writer cannot stretch a bounded close.

Another connection (or, for the flock, another open file) holds the lock for real; the store's
busy timeout is a minute, so a wait that the bound did not end would outlast the test's join
guard and fail it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.claims.gated import Worker
from tests.support.waiting import wait_until
from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import SqliteStorage
from weft_sync.storage.sqlite import fork as sqlite_fork
from weft_sync.storage.wait_bound import SupportsWaitBound

TABLE = "kv"
MINUTE_MS = 60_000


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@contextlib.contextmanager
def foreign_write_lock(db_path: Path) -> Iterator[None]:
    """Hold the database's write lock on a connection of its own until the block ends."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


@contextlib.contextmanager
def foreign_flock(db_path: Path) -> Iterator[None]:
    """Hold the writer flock the way another process's store would (its own open file)."""
    fd = os.open(f"{db_path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _writing(store: SqliteStorage) -> bool:
    """Whether a write transaction began (it then waits for the lock or commits)."""
    writer = store._writer
    return writer is not None and writer.fast_commits + writer.group_commits > 0


def test_sqlite_storage_supports_wait_bounds(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE) as store:
        assert isinstance(store, SupportsWaitBound)


def test_a_write_waiting_for_a_foreign_write_lock_gives_up_at_the_bound(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS) as store:
        with foreign_write_lock(db_path):
            put = Worker(lambda: store.put("k", b"v"), "blocked-put")
            wait_until(lambda: _writing(store), "the put to start its transaction")
            store.bound_waits(time.monotonic())
            error = put.error()
            assert isinstance(error, StorageError)
            assert "gave up at the close deadline" in str(error)
            assert "database is locked" in str(error)
            assert str(db_path) in str(error)
        assert store.get("k") is None
        # Past the bound a free lock is still taken: one attempt, no wait.
        store.put("k", b"after")
        assert store.get("k") == b"after"
        store.bound_waits(None)
        store.put("k", b"lifted")
        assert store.get("k") == b"lifted"


def test_a_write_waiting_for_another_stores_flock_gives_up_at_the_bound(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS) as store:
        with foreign_flock(db_path):
            put = Worker(lambda: store.put("k", b"v"), "blocked-put")
            wait_until(lambda: _writing(store), "the put to start its transaction")
            store.bound_waits(time.monotonic())
            error = put.error()
            assert isinstance(error, StorageError)
            assert "gave up at the close deadline" in str(error)
            assert "writer lock" in str(error)
        assert store.get("k") is None


def test_without_a_bound_the_busy_timeout_still_ends_the_wait(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=120) as store:
        with foreign_write_lock(db_path), pytest.raises(StorageError) as info:
            store.put("k", b"v")
        assert "database is locked" in str(info.value)
        assert "close deadline" not in str(info.value)
        store.put("k", b"v")
        assert store.get("k") == b"v"


def test_an_earlier_bound_stays_until_lifted(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS) as store:
        store.bound_waits(time.monotonic())
        store.bound_waits(time.monotonic() + 3600)  # later: the earlier one still holds
        with foreign_write_lock(db_path), pytest.raises(StorageError, match="close deadline"):
            store.put("k", b"v")


def test_close_with_a_timeout_ends_a_write_stuck_behind_a_foreign_lock(db_path: Path) -> None:
    store = SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS)
    store.put("before", b"1")
    with foreign_write_lock(db_path):
        put = Worker(lambda: store.put("k", b"v"), "blocked-put")
        wait_until(lambda: _writing(store), "the put to start its transaction")
        queued = Worker(lambda: store.put("k2", b"v"), "queued-put")
        wait_until(lambda: store._queue.qsize() == 1, "the second put to queue")
        store.close(timeout=0.2)
        assert isinstance(put.error(), StorageError)
        # The queued request never reached SQLite: close() failed it.
        assert isinstance(queued.error(), ClosedError)
        writer = store._writer
        assert writer is not None and not writer.is_alive()
        assert writer.connection is None
        assert store not in sqlite_fork.live()
        with pytest.raises(ClosedError):
            store.put("k", b"v")
    with SqliteStorage(db_path, table=TABLE) as reopened:
        assert reopened.scan() == [("before", b"1")]
        reopened.put("k", b"v")
        assert reopened.get("k") == b"v"
    check = sqlite3.connect(db_path)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        check.close()


def test_close_after_a_bound_joins_the_writer_without_a_timeout_of_its_own(
    db_path: Path,
) -> None:
    store = SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS)
    with foreign_write_lock(db_path):
        put = Worker(lambda: store.put("k", b"v"), "blocked-put")
        wait_until(lambda: _writing(store), "the put to start its transaction")
        store.bound_waits(time.monotonic() + 0.1)
        store.close()
        assert isinstance(put.error(), StorageError)
        writer = store._writer
        assert writer is not None and not writer.is_alive()
        assert store not in sqlite_fork.live()


def test_only_the_write_connection_waits_in_slices_of_fifty_milliseconds(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=MINUTE_MS) as store:
        store.put("k", b"v")
        writer = store._writer
        assert writer is not None and writer.connection is not None
        assert writer.connection.execute("PRAGMA busy_timeout").fetchone()[0] == 50
        with store._readers.for_thread() as reader:
            assert reader.execute("PRAGMA busy_timeout").fetchone()[0] == MINUTE_MS
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=20) as store:
        store.put("k", b"w")
        writer = store._writer
        assert writer is not None and writer.connection is not None
        assert writer.connection.execute("PRAGMA busy_timeout").fetchone()[0] == 20
