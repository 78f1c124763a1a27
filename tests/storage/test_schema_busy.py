"""Opening a SQLite store tries its schema steps again while the file answers "locked".

SQLite answers ``SQLITE_BUSY`` at once, without its busy wait, while another process's last
connection checkpoints and removes the WAL as it closes: a worker opening the store just then
(a web server starting one worker as another stops) must not fail its open. The connection
here is a real ``sqlite3`` connection on a real file whose first statements answer "database
is locked", as SQLite does in that window.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from weft_sync.storage import SqliteStorage
from weft_sync.storage.sqlite.schema import create_schema
from weft_sync.storage.sqlite.writer import WriterFileLock


def _locked_for(times: int) -> type[sqlite3.Connection]:
    """A connection class whose first ``times`` statements raise SQLITE_BUSY."""
    left = [times]

    class LockedAtFirst(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if left[0] > 0:
                left[0] -= 1
                raise sqlite3.OperationalError("database is locked")
            return super().execute(sql, *args)

    return LockedAtFirst


def _schema(path: Path, factory: type[sqlite3.Connection], busy_timeout_ms: int) -> None:
    lock = WriterFileLock(str(path) + ".lock", busy_timeout_ms)
    try:
        create_schema(
            str(path),
            "weft_kv",
            lambda: sqlite3.connect(path, isolation_level=None, factory=factory),
            lock,
            replaces_deleted=False,
            busy_timeout_ms=busy_timeout_ms,
        )
    finally:
        lock.close()


def test_a_file_locked_for_a_moment_at_open_is_opened(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    _schema(path, _locked_for(3), busy_timeout_ms=5_000)
    with SqliteStorage(path) as store:  # the table and the store id are there
        store.put("k", b"v")
        assert store.get("k") == b"v"


def test_a_file_that_stays_locked_fails_the_open_after_the_busy_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        _schema(tmp_path / "store.db", _locked_for(10**6), busy_timeout_ms=300)
    assert 0.25 <= time.monotonic() - started < 5.0
