"""SqliteStorage commits an uncontended write on the caller's thread and groups contended ones."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.forking import expected_fork_warning
from tests.support.waiting import wait_until
from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import Condition, Put, SqliteStorage
from weft_sync.storage.sqlite.writer import SqliteWriter

TABLE = "kv"
POLL_S = 0.002
"""How often a wait in these tests looks again, in seconds."""


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[SqliteStorage]:
    with SqliteStorage(db_path, table=TABLE) as opened:
        yield opened


class _Gate:
    """Record which thread starts each write transaction; hold the first one until opened."""

    def __init__(self, store: SqliteStorage, monkeypatch: pytest.MonkeyPatch) -> None:
        self.holders: list[str] = []
        self.first_entered = threading.Event()
        self.release = threading.Event()
        original = store._file_lock.hold

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            self.holders.append(threading.current_thread().name)
            if len(self.holders) == 1:
                self.first_entered.set()
                assert self.release.wait(timeout=30)
            with original():
                yield

        monkeypatch.setattr(store._file_lock, "hold", hold)


def _writer(store: SqliteStorage) -> SqliteWriter:
    assert store._writer is not None
    return store._writer


def _thread(name: str, target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    return threading.Thread(target=run, name=name, daemon=True)


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=5)


def test_a_lone_sequential_writer_commits_every_write_on_its_own_thread(
    store: SqliteStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("k", b"0")
    gate = _Gate(store, monkeypatch)
    gate.release.set()
    for n in range(1, 20):
        assert store.conditional_batch([Condition("k", b"%d" % (n - 1))], [Put("k", b"%d" % n)])
    store.delete("gone")
    assert gate.holders == [threading.current_thread().name] * 20
    assert (_writer(store).fast_commits, _writer(store).group_commits) == (21, 0)
    check = _raw(store.path)
    assert check.execute(f'SELECT value FROM "{TABLE}" WHERE key = ?', ("k",)).fetchone() == (
        b"19",
    )
    check.close()


def test_writes_arriving_during_a_commit_are_committed_together_by_the_writer_thread(
    store: SqliteStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(store, monkeypatch)
    errors: list[BaseException] = []
    first = _thread("first", lambda: store.put("first", b"v"), errors)
    first.start()
    assert gate.first_entered.wait(timeout=10)
    queued = [_thread(f"q{i}", lambda i=i: store.put(f"q{i}", b"v"), errors) for i in range(8)]
    for thread in queued:
        thread.start()
    # The writer thread takes queued requests only under the transaction lock "first" holds.
    wait_until(lambda: store._queue.qsize() == 8, "8 requests are queued", poll_s=POLL_S)
    gate.release.set()
    for thread in [first, *queued]:
        thread.join(timeout=30)
    for exc in errors:
        raise exc
    writer = _writer(store)
    assert (writer.fast_commits, writer.group_commits) == (1, 1)
    assert gate.holders == ["first", writer.name]
    assert [k for k, _ in store.scan()] == ["first"] + [f"q{i}" for i in range(8)]


def test_one_callers_writes_apply_in_call_order_while_other_threads_write(
    store: SqliteStorage,
) -> None:
    rounds, others = 60, 4
    done = threading.Event()
    start = threading.Barrier(others + 1)
    errors: list[BaseException] = []
    outcomes: list[bool] = []

    def chain() -> None:
        start.wait(timeout=30)
        try:
            for n in range(rounds):
                current = None if n == 0 else b"%d" % (n - 1)
                ok = store.conditional_batch(
                    [Condition("chain", current)], [Put("chain", b"%d" % n)]
                )
                outcomes.append(ok)
        finally:
            done.set()

    def noise(i: int) -> None:
        start.wait(timeout=30)
        n = 0
        while not done.is_set():
            store.put(f"noise{i}", b"%d" % n)
            n += 1

    threads = [_thread("chain", chain, errors)] + [
        _thread(f"noise{i}", lambda i=i: noise(i), errors) for i in range(others - 1)
    ]
    for thread in threads:
        thread.start()
    start.wait(timeout=30)  # the test thread writes too
    n = 0
    while not done.is_set():
        store.put("noise-main", b"%d" % n)
        n += 1
    for thread in threads:
        thread.join(timeout=60)
    for exc in errors:
        raise exc
    assert outcomes == [True] * rounds
    assert store.get("chain") == b"%d" % (rounds - 1)


def test_close_waits_for_a_write_being_committed_on_the_callers_thread(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqliteStorage(db_path, table=TABLE)
    gate = _Gate(store, monkeypatch)
    errors: list[BaseException] = []
    writer_thread = _thread("fast", lambda: store.put("k", b"committed"), errors)
    writer_thread.start()
    assert gate.first_entered.wait(timeout=10)
    closer = _thread("closer", store.close, errors)
    closer.start()
    wait_until(lambda: "closed" in repr(store), "close() has begun", poll_s=POLL_S)
    with pytest.raises(ClosedError):
        store.put("late", b"v")
    closer.join(timeout=0.05)
    assert closer.is_alive()  # waiting for the commit in progress
    gate.release.set()
    writer_thread.join(timeout=30)
    closer.join(timeout=30)
    assert not closer.is_alive()
    for exc in errors:
        raise exc
    assert _writer(store).connection is None
    assert gate.holders == ["fast"]
    with SqliteStorage(db_path, table=TABLE) as reopened:
        assert reopened.scan() == [("k", b"committed")]


def test_a_foreign_write_lock_fails_an_uncontended_write_with_storage_error(
    db_path: Path,
) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=50) as store:
        blocker = _raw(db_path)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StorageError, match="locked") as info:
                store.conditional_batch([Condition("k", None)], [Put("k", b"v")])
            assert isinstance(info.value.__cause__, sqlite3.OperationalError)
            assert store.get("k") is None
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert (_writer(store).fast_commits, _writer(store).group_commits) == (1, 0)
        assert store.conditional_batch([Condition("k", None)], [Put("k", b"v")])
        assert store.get("k") == b"v"


def test_a_foreign_process_lock_fails_an_uncontended_write_with_storage_error(
    db_path: Path,
) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=50) as store:
        fd = os.open(f"{db_path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(StorageError, match=r"store\.db\.lock"):
                store.put("k", b"v")
            assert store.get("k") is None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        assert (_writer(store).fast_commits, _writer(store).group_commits) == (1, 0)
        store.put("k", b"v")
        assert store.get("k") == b"v"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_during_a_callers_commit_does_not_wait_for_it_and_the_commit_completes(
    store: SqliteStorage, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("before", b"v")  # the parent has a write connection
    gate = _Gate(store, monkeypatch)
    errors: list[BaseException] = []
    committing = _thread("fast", lambda: store.put("parent", b"v"), errors)
    committing.start()
    assert gate.first_entered.wait(timeout=10)  # "fast" holds the transaction lock
    try:
        with expected_fork_warning():
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            signal.alarm(20)  # a child stuck on the inherited lock dies instead of hanging
            status = 1
            try:
                try:
                    store.get("before")
                except ClosedError:
                    status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not gate.release.is_set()  # the commit was still held: the fork did not wait
    finally:
        gate.release.set()
        committing.join(timeout=30)
    for exc in errors:
        raise exc
    assert [k for k, _ in store.scan()] == ["before", "parent"]


@pytest.mark.parametrize("where", ["after_begin", "before_commit"])
def test_an_interrupt_inside_a_write_transaction_leaves_no_transaction_open(
    store: SqliteStorage, db_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A KeyboardInterrupt (Ctrl-C in a cron-style ``maintain`` on the main thread) can land
    between any two statements of a write; the write fails, and the store's next write, and
    another connection's, go through: no transaction is left open holding SQLite's lock."""
    store.put("warm", b"0")  # the writer starts with the first write
    writer = _writer(store)
    interrupts = [1]
    if where == "after_begin":
        original = writer._begin_immediate

        def begin_then_interrupt(conn: sqlite3.Connection) -> None:
            original(conn)
            if interrupts and interrupts.pop():
                raise KeyboardInterrupt

        monkeypatch.setattr(writer, "_begin_immediate", begin_then_interrupt)
    else:

        def interrupt() -> None:
            if interrupts and interrupts.pop():
                raise KeyboardInterrupt

        monkeypatch.setattr(writer, "_before_commit", interrupt)
    with pytest.raises(KeyboardInterrupt):
        store.put("a", b"1")
    assert interrupts == []
    assert store.get("a") is None
    store.put("b", b"2")
    other = sqlite3.connect(db_path, timeout=0.1, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the write lock is free
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert store.get("b") == b"2"
