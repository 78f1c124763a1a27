"""The pre-commit identity check of SQLite's ``-wal``/``-shm`` rests on their directory's stamp.

A commit looks at the log and its index only when their directory changed since they were last
found intact (or its last change was too recent to trust the stamp); the database file itself is
looked at on every commit. Faults are real (``os.unlink``, ``os.replace``); the stat calls are
counted through a wrapper of ``os.stat`` that forwards every call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weft_sync.errors import StoreIdentityError
from weft_sync.storage import SqliteStorage
from weft_sync.storage.sqlite import identity

MARGIN_NS = 50_000_000


class StatCounter:
    """Counts ``os.stat`` calls per path suffix; every call goes to the real ``os.stat``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, db_path: Path) -> None:
        self._real = os.stat
        self._db = str(db_path)
        self.calls: list[str] = []
        monkeypatch.setattr(identity.os, "stat", self)

    def __call__(self, path: object, *args: object, **kwargs: object) -> os.stat_result:
        name = os.fspath(path)  # type: ignore[call-overload]
        if isinstance(name, str) and name.startswith(self._db):
            self.calls.append(name[len(self._db) :] or "db")
        return self._real(path, *args, **kwargs)  # type: ignore[arg-type]

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    directory = tmp_path / "store"
    directory.mkdir()
    return directory / "store.db"


@pytest.fixture
def settled(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SqliteStorage]:
    """A store whose directory has settled: its stamp stands for the log and the index."""
    monkeypatch.setattr(identity, "DIR_STAMP_MARGIN_NS", MARGIN_NS)
    with SqliteStorage(db_path, table="kv") as store:
        store.put("first", b"v")
        time.sleep(3 * MARGIN_NS / 1e9)
        store.put("settles", b"v")  # a full check, now under a stamp old enough to trust
        yield store


def test_commits_under_a_settled_directory_look_at_the_database_file_only(
    settled: SqliteStorage, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats = StatCounter(monkeypatch, db_path)
    for n in range(20):
        settled.put(f"k{n}", b"v")
    calls = stats.take()
    assert calls.count("db") == 20
    assert "-wal" not in calls and "-shm" not in calls
    assert [k for k, _ in settled.scan("k")] == sorted(f"k{n}" for n in range(20))


def test_a_new_name_in_the_directory_makes_the_next_commit_look_again(
    settled: SqliteStorage, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats = StatCounter(monkeypatch, db_path)
    (db_path.parent / "unrelated.txt").write_text("x")
    settled.put("a", b"v")
    assert {"-wal", "-shm"} <= set(stats.take())
    settled.put("b", b"v")  # the change is recent: the stamp is not trusted yet
    assert {"-wal", "-shm"} <= set(stats.take())
    time.sleep(3 * MARGIN_NS / 1e9)
    settled.put("c", b"v")  # a full check under an old enough stamp
    stats.take()
    settled.put("d", b"v")
    assert stats.take() == ["db"]


@pytest.mark.parametrize(("suffix", "detail"), [("-wal", "write-ahead log"), ("-shm", "WAL index")])
def test_a_log_or_index_deleted_under_a_settled_directory_fails_the_next_commit(
    settled: SqliteStorage, db_path: Path, suffix: str, detail: str
) -> None:
    os.unlink(f"{db_path}{suffix}")
    with pytest.raises(StoreIdentityError, match="was deleted") as raised:
        settled.put("after", b"v")
    assert detail in raised.value.detail
    with pytest.raises(StoreIdentityError):
        settled.get("first")


def test_a_log_replaced_under_a_settled_directory_fails_the_next_commit(
    settled: SqliteStorage, db_path: Path
) -> None:
    impostor = db_path.parent / "impostor"
    impostor.write_bytes(b"")
    os.replace(impostor, f"{db_path}-wal")
    with pytest.raises(StoreIdentityError, match="was replaced") as raised:
        settled.put("after", b"v")
    assert "write-ahead log" in raised.value.detail


def test_a_database_replaced_under_a_settled_directory_fails_the_next_commit(
    settled: SqliteStorage, db_path: Path
) -> None:
    other = db_path.parent / "other.db"
    with SqliteStorage(other, table="kv") as store:
        store.put("k", b"other")
    os.replace(other, db_path)
    with pytest.raises(StoreIdentityError, match="was replaced") as raised:
        settled.put("after", b"v")
    assert "database file" in raised.value.detail


def test_a_fresh_directory_stamp_is_not_trusted(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default margin: right after opening (the files were just created), every commit
    # looks at the log and the index.
    assert identity.DIR_STAMP_MARGIN_NS >= 2_000_000_000
    with SqliteStorage(db_path, table="kv") as store:
        store.put("first", b"v")
        stats = StatCounter(monkeypatch, db_path)
        for n in range(3):
            store.put(f"k{n}", b"v")
            assert {"db", "-wal", "-shm"} <= set(stats.take())
