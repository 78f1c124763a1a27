"""``truncate -s 0`` of the live SQLite file is noticed before the next write commits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weft_sync.errors import StoreIdentityError
from weft_sync.storage import Condition, Put
from weft_sync.storage.sqlite.store import SqliteStorage

pytestmark = pytest.mark.timeout(60)


def test_a_write_after_the_live_file_is_truncated_fails_and_commits_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    storage = SqliteStorage(str(path))
    try:
        storage.put("k", b"1")
        # Make sure the file holds pages (as it does once any checkpoint ran).
        storage.put("k2", b"2")
        if os.stat(path).st_size < 100:
            import sqlite3

            conn = sqlite3.connect(path)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()
        assert os.stat(path).st_size >= 100
        os.truncate(path, 0)
        with pytest.raises(StoreIdentityError, match="truncated to 0 bytes"):
            storage.put("after", b"x")
        with pytest.raises(StoreIdentityError):
            storage.conditional_batch([Condition("k", b"1")], [Put("after", b"y")])
    finally:
        storage.close()


def test_a_fresh_store_whose_file_is_still_empty_is_not_judged_truncated(tmp_path: Path) -> None:
    storage = SqliteStorage(str(tmp_path / "fresh.db"))
    try:
        for i in range(20):
            storage.put(f"k{i}", b"v")
        assert storage.get("k19") == b"v"
    finally:
        storage.close()
