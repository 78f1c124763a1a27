"""SQLite-specific behaviour of SqliteStorage: pragmas, schema, sqlitedict, writer thread, fork."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlitedict import SqliteDict

from tests.forking import expected_fork_warning
from tests.support.waiting import wait_until
from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import Condition, Put, SqliteStorage

TABLE = "kv"
POLL_S = 0.002
"""How often a wait in these tests looks again, in seconds."""


def _identity(value: object) -> object:
    return value


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[SqliteStorage]:
    with SqliteStorage(db_path, table=TABLE) as opened:
        yield opened


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=5)


def _read_conn(store: SqliteStorage) -> sqlite3.Connection:
    """The calling thread's read connection of ``store``."""
    conn = store._readers.for_thread().conn
    assert conn is not None
    return conn


def _wal_frames(path: Path) -> int:
    wal = Path(f"{path}-wal")
    if not wal.exists() or wal.stat().st_size < 32:
        return 0
    header = wal.read_bytes()[:32]
    page_size = int.from_bytes(header[8:12], "big")
    return (wal.stat().st_size - 32) // (24 + page_size)


@contextlib.contextmanager
def _writer_lock_held(path: Path) -> Iterator[None]:
    """Hold the cross-process writer lock as another process would."""
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _occupy_writer(store: SqliteStorage, thread: threading.Thread) -> None:
    """Start ``thread`` (one write on a store that has not written yet) and wait until the
    writer thread has taken its request; with the writer lock held elsewhere it waits there."""

    def taken() -> bool:
        # Writer creation and the first enqueue happen together under the storage's lock.
        with store._lock:
            return store._writer is not None and store._queue.qsize() == 0

    assert store._writer is None
    thread.start()
    wait_until(taken, "the writer took the first request", poll_s=POLL_S)


def _wait_until_queued(store: SqliteStorage, count: int) -> None:
    wait_until(lambda: store._queue.qsize() >= count, f"{count} requests are queued", poll_s=POLL_S)


def _run_threads(targets: list[threading.Thread]) -> None:
    for thread in targets:
        thread.start()


# -- configuration --------------------------------------------------------------------------


def test_database_uses_wal_journal_and_the_configured_busy_timeout(db_path: Path) -> None:
    with SqliteStorage(db_path, busy_timeout_ms=1234) as store:
        conn = _read_conn(store)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
    raw = _raw(db_path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()


@pytest.mark.parametrize(("mode", "level"), [("FULL", 2), ("NORMAL", 1), ("normal", 1)])
def test_synchronous_mode_is_applied_to_connections(db_path: Path, mode: str, level: int) -> None:
    with SqliteStorage(db_path, synchronous=mode) as store:
        assert _read_conn(store).execute("PRAGMA synchronous").fetchone()[0] == level


def test_synchronous_defaults_to_full(store: SqliteStorage) -> None:
    assert _read_conn(store).execute("PRAGMA synchronous").fetchone()[0] == 2


@pytest.mark.parametrize("mode", ["OFF", "EXTRA", "FULL; DROP TABLE kv", 2])
def test_invalid_synchronous_mode_is_refused_naming_the_valid_ones(
    db_path: Path, mode: object
) -> None:
    with pytest.raises(ValueError, match="FULL, NORMAL") as info:
        SqliteStorage(db_path, synchronous=mode)  # type: ignore[arg-type]
    assert repr(mode) in str(info.value)
    assert not db_path.exists()


@pytest.mark.parametrize("table", ["kv; DROP TABLE x", 'kv"', "", "1kv", "k" * 64, None])
def test_table_name_that_is_not_a_plain_identifier_is_refused(db_path: Path, table: object) -> None:
    with pytest.raises(ValueError, match="invalid table name") as info:
        SqliteStorage(db_path, table=table)  # type: ignore[arg-type]
    assert repr(table) in str(info.value)
    assert not db_path.exists()


@pytest.mark.parametrize("timeout", [-1, 1.5, "100", True])
def test_bad_busy_timeout_is_refused(db_path: Path, timeout: object) -> None:
    with pytest.raises(ValueError, match="busy_timeout_ms"):
        SqliteStorage(db_path, busy_timeout_ms=timeout)  # type: ignore[arg-type]


def test_in_memory_database_is_refused() -> None:
    with pytest.raises(ValueError, match="':memory:'"):
        SqliteStorage(":memory:")


def test_unopenable_file_raises_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="missing-dir"):
        SqliteStorage(tmp_path / "missing-dir" / "store.db")


def test_capabilities_promise_one_host_many_processes(store: SqliteStorage) -> None:
    caps = store.capabilities
    assert (caps.conditional_batch, caps.multi_process, caps.multi_host) == (True, True, False)


# -- schema and sqlitedict ------------------------------------------------------------------


def test_schema_is_the_one_sqlitedict_creates(store: SqliteStorage, tmp_path: Path) -> None:
    other = tmp_path / "by_sqlitedict.db"
    SqliteDict(other, tablename=TABLE, flag="c", outer_stack=False).close()
    query = "SELECT type, sql FROM sqlite_master WHERE tbl_name = ? ORDER BY name"
    ours, theirs = _raw(store_path(store)), _raw(other)
    try:
        assert (
            ours.execute(query, (TABLE,)).fetchall() == theirs.execute(query, (TABLE,)).fetchall()
        )
        assert ours.execute(query, (TABLE,)).fetchall()[0] == (
            "table",
            f'CREATE TABLE "{TABLE}" (key TEXT PRIMARY KEY, value BLOB)',
        )
        store.put("k", b"v")
        assert ours.execute(f'SELECT rowid, typeof(value) FROM "{TABLE}"').fetchall() == [
            (1, "blob")
        ]
    finally:
        ours.close()
        theirs.close()


def store_path(store: SqliteStorage) -> Path:
    return Path(store.path)


def test_dict_view_sees_commits_made_before_and_after_it_opened(store: SqliteStorage) -> None:
    store.put("a", b"\x00A")
    view = store.dict_view()
    try:
        assert dict(view) == {"a": b"\x00A"}
        store.batch([Put("b", b"B"), Put("a", b"A2")])
        assert sorted(view.items()) == [("a", b"A2"), ("b", b"B")]
        assert len(view) == 2
        with pytest.raises(RuntimeError, match="read-only"):
            view["c"] = b"C"
    finally:
        view.close()
    assert store.get("c") is None


def test_table_written_through_sqlitedict_is_readable_and_casable(db_path: Path) -> None:
    with SqliteDict(
        db_path,
        tablename=TABLE,
        journal_mode="WAL",
        encode=_identity,
        decode=_identity,
        outer_stack=False,
    ) as written:
        written["b"] = b"\xffB"
        written["a"] = b"A"
        written["text"] = "stored as TEXT"
        written.commit()
    with SqliteStorage(db_path, table=TABLE) as store:
        assert store.scan() == [("a", b"A"), ("b", b"\xffB"), ("text", b"stored as TEXT")]
        assert store.get("text") == b"stored as TEXT"
        assert store.conditional_batch([Condition("text", b"stored as TEXT")], [Put("a", b"A2")])
        assert store.get("a") == b"A2"
        # A TEXT value defeats the UPDATE … WHERE value = ? fast path; row by row it matches.
        rows = [("a", b"A2", b"A3"), ("text", b"stored as TEXT", b"now bytes"), ("b", b"x", b"")]
        assert store.compare_and_set_many(rows) == [True, True, False]
        assert store.scan() == [("a", b"A3"), ("b", b"\xffB"), ("text", b"now bytes")]


# -- the writer thread ----------------------------------------------------------------------


def test_concurrent_writers_each_get_their_own_correct_result(store: SqliteStorage) -> None:
    threads_n, rounds = 16, 20
    start = threading.Barrier(threads_n)
    errors: list[BaseException] = []
    results: dict[int, list[bool]] = {}

    def worker(i: int) -> None:
        try:
            start.wait(timeout=30)
            key, outcomes = f"k{i:02d}", []
            for n in range(rounds):
                current = None if n == 0 else str(n - 1).encode()
                outcomes.append(
                    store.conditional_batch([Condition(key, current)], [Put(key, b"%d" % n)])
                )
                # A stale expectation must fail even when grouped with successful requests.
                outcomes.append(
                    not store.conditional_batch([Condition(key, b"stale")], [Put(key, b"x")])
                )
            results[i] = outcomes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"w{i}") for i in range(threads_n)]
    _run_threads(threads)
    for thread in threads:
        thread.join(timeout=60)
    for exc in errors:
        raise exc
    assert all(all(r) and len(r) == 2 * rounds for r in results.values())
    assert len(results) == threads_n
    assert store.scan() == [(f"k{i:02d}", str(rounds - 1).encode()) for i in range(threads_n)]


def test_queued_writes_commit_together_in_one_transaction(
    store: SqliteStorage, db_path: Path
) -> None:
    n = 12
    errors: list[BaseException] = []
    results: list[bool] = []

    def worker(i: int) -> None:
        try:
            key = f"k{i:02d}"
            results.append(store.conditional_batch([Condition(key, None)], [Put(key, b"v")]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"g{i}") for i in range(n + 1)]
    before = _wal_frames(db_path)
    with _writer_lock_held(db_path):
        _occupy_writer(store, threads[0])
        _run_threads(threads[1:])
        _wait_until_queued(store, n)
    for thread in threads:
        thread.join(timeout=30)
    for exc in errors:
        raise exc
    assert results == [True] * (n + 1)
    assert len(store.scan("k")) == n + 1
    # Two transactions (the first request, then the n queued behind it) write a few pages each;
    # one transaction per request would append at least 2 * (n + 1) frames.
    assert _wal_frames(db_path) - before <= 6


def test_a_failing_request_leaves_the_others_in_its_group_committed(
    store: SqliteStorage, db_path: Path
) -> None:
    raw = _raw(db_path)
    raw.execute(
        f"CREATE TRIGGER refuse_poison BEFORE INSERT ON \"{TABLE}\" WHEN NEW.key = 'poison' "
        f"BEGIN SELECT RAISE(ABORT, 'poison refused'); END"
    )
    raw.close()
    outcomes: dict[str, object] = {}

    def worker(name: str, batches: list[tuple[list[Condition], list[Put]]]) -> None:
        try:
            outcomes[name] = store.conditional_batches(batches)
        except BaseException as exc:
            outcomes[name] = exc

    plan = {
        "first": [([], [Put("a", b"1")])],
        "poisoned": [([], [Put("b", b"1")]), ([], [Put("poison", b"1")])],
        "grouped": [([Condition("a", b"1")], [Put("c", b"1")])],
        "grouped-cas-fails": [([Condition("a", b"stale")], [Put("d", b"1")])],
    }
    threads = [
        threading.Thread(target=worker, args=(name, batches), name=name)
        for name, batches in plan.items()
    ]
    with _writer_lock_held(db_path):
        _occupy_writer(store, threads[0])
        _run_threads(threads[1:])
        _wait_until_queued(store, len(threads) - 1)
    for thread in threads:
        thread.join(timeout=30)
    assert outcomes["first"] == [True]
    assert outcomes["grouped"] == [True]
    assert outcomes["grouped-cas-fails"] == [False]
    poisoned = outcomes["poisoned"]
    assert isinstance(poisoned, StorageError)
    assert "poison refused" in str(poisoned)
    assert store.scan() == [("a", b"1"), ("c", b"1")]


def test_write_waits_for_a_foreign_write_lock_then_raises_storage_error(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=200) as store:
        store.put("k", b"before")
        blocker = _raw(db_path)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            started = time.monotonic()
            with pytest.raises(StorageError, match="locked") as info:
                store.conditional_batch([Condition("k", b"before")], [Put("k", b"after")])
            assert time.monotonic() - started >= 0.15
            assert isinstance(info.value.__cause__, sqlite3.OperationalError)
            assert store.get("k") == b"before"  # WAL readers are not blocked by the writer
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        store.put("k", b"after")
        assert store.get("k") == b"after"
    check = _raw(db_path)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()


def test_a_failed_group_transaction_fails_every_request_in_it(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=100) as store:
        outcomes: dict[int, object] = {}

        def worker(i: int) -> None:
            try:
                outcomes[i] = store.conditional_batch([], [Put(f"k{i}", b"v")])
            except BaseException as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=worker, args=(i,), name=f"f{i}") for i in range(4)]
        blocker = _raw(db_path)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            _occupy_writer(store, threads[0])
            _run_threads(threads[1:])
            _wait_until_queued(store, 3)
            for thread in threads:
                thread.join(timeout=30)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        errors = list(outcomes.values())
        assert all(isinstance(e, StorageError) for e in errors), errors
        assert len({id(e) for e in errors}) == 4
        assert store.scan() == []


def test_write_waits_for_the_cross_process_lock_within_the_busy_timeout(db_path: Path) -> None:
    with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=150) as store:
        with _writer_lock_held(db_path), pytest.raises(StorageError, match=r"store\.db\.lock"):
            store.put("k", b"v")
        assert store.get("k") is None
        store.put("k", b"v")
        assert store.get("k") == b"v"


def test_close_joins_the_writer_thread(db_path: Path) -> None:
    store = SqliteStorage(db_path, table=TABLE)
    before = set(threading.enumerate())
    store.put("k", b"v")
    writers = [t for t in threading.enumerate() if t not in before]
    assert [t.name.startswith("weft-sqlite-writer") for t in writers] == [True]
    assert writers[0].daemon
    store.close()
    assert not writers[0].is_alive()


def test_writes_racing_with_close_finish_or_raise_closed_error(db_path: Path) -> None:
    store = SqliteStorage(db_path, table=TABLE)
    started = threading.Barrier(9)
    outcomes: list[str] = []

    def writer(i: int) -> None:
        started.wait(timeout=30)
        n = 0
        try:
            while True:
                store.put(f"k{i}", b"%d" % n)
                n += 1
        except ClosedError:
            outcomes.append("closed")
        except BaseException as exc:
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(i,), name=f"c{i}") for i in range(8)]
    _run_threads(threads)
    started.wait(timeout=30)
    store.put("main", b"x")
    store.close()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert outcomes == ["closed"] * 8


def test_close_fails_queued_requests_and_finishes_the_one_being_committed(
    db_path: Path,
) -> None:
    store = SqliteStorage(db_path, table=TABLE)
    outcomes: dict[int, object] = {}

    def worker(i: int) -> None:
        try:
            outcomes[i] = store.conditional_batch([], [Put(f"k{i}", b"v")])
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), name=f"q{i}") for i in range(3)]
    closer = threading.Thread(target=store.close, name="closer")
    with _writer_lock_held(db_path):
        _occupy_writer(store, threads[0])
        _run_threads(threads[1:])
        _wait_until_queued(store, 2)
        closer.start()
        for thread in threads[1:]:
            thread.join(timeout=30)
        assert closer.is_alive()  # still waiting for the transaction in progress
    closer.join(timeout=30)
    threads[0].join(timeout=30)
    assert outcomes[0] is True
    assert isinstance(outcomes[1], ClosedError)
    assert isinstance(outcomes[2], ClosedError)
    with SqliteStorage(db_path, table=TABLE) as reopened:
        assert reopened.scan() == [("k0", b"v")]


def test_reader_connections_of_finished_threads_are_closed(store: SqliteStorage) -> None:
    def read() -> None:
        store.get("k")

    for i in range(3):
        thread = threading.Thread(target=read, name=f"r{i}")
        thread.start()
        thread.join()
    store.get("k")
    assert len(store._readers._readers) == 1


# -- fork -----------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_refuses_the_inherited_storage_and_writes_through_its_own(
    store: SqliteStorage,
) -> None:
    store.put("n", b"parent")
    assert store.get("n") == b"parent"  # the parent now has a reader and a writer thread
    path = store_path(store)
    with expected_fork_warning():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        signal.alarm(20)  # a child stuck on inherited state dies instead of hanging the test
        status = 1
        try:
            refused = 0
            for use in (lambda: store.get("n"), lambda: store.put("c", b"0")):
                try:
                    use()
                except ClosedError:
                    refused += 1
            store.close()  # quiet: lets go of the inherited copies only
            with SqliteStorage(path, table=TABLE) as own:
                ok = own.conditional_batch([Condition("n", b"parent")], [Put("n", b"child")])
                ok = ok and own.get("n") == b"child"
                ok = ok and own.conditional_batches([([], [Put("c", b"1")])]) == [True]
            status = 0 if ok and refused == 2 else 3
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("n") == b"child"
    assert store.conditional_batch([Condition("n", b"child")], [Put("n", b"parent again")])
    assert store.scan() == [("c", b"1"), ("n", b"parent again")]
    check = _raw(store_path(store))
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()


def _scan_steps(store: SqliteStorage, prefix: str, gt: str) -> tuple[int, list[str]]:
    """SQLite virtual-machine steps (in hundreds) one bounded scan takes, and its keys."""
    conn = _read_conn(store)
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    conn.set_progress_handler(count, 100)
    try:
        keys = [key for key, _ in store.scan(prefix, gt=gt, limit=10)]
    finally:
        conn.set_progress_handler(None, 0)
    return steps[0], keys


def test_a_scan_deep_into_a_prefix_costs_what_one_at_its_start_costs(
    store: SqliteStorage,
) -> None:
    store.batch([Put(f"p:{n:05d}", b"v") for n in range(5_000)])
    store.batch([Put(f"o:{n:05d}", b"v") for n in range(100)] + [Put("q:after", b"v")])
    near, near_keys = _scan_steps(store, "p:", "p:00010")
    deep, deep_keys = _scan_steps(store, "p:", "p:04900")
    assert near_keys == [f"p:{n:05d}" for n in range(11, 21)]
    assert deep_keys == [f"p:{n:05d}" for n in range(4901, 4911)]
    # Bounded by the cursor, not by the prefix: walking the 4,900 keys before it would take
    # tens of thousands of steps more.
    assert deep <= near + 5
