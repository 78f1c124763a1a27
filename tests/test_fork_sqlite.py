"""Fork safety on SQLite: a child's own store works whatever the parent was doing at fork time.

The parent is paused at a chosen point of a write or read when the fork is requested: a test
before-fork hook, registered after the library's and so run before it, tells a helper thread
that the fork has been requested, and only then does the helper let the parent's transaction
go on. The library's hook then waits for the transaction and the fork proceeds. Children report
through their exit code and a traceback file, and leave with ``os._exit``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from tests.forking import armed_fork, fork_child, wait_child
from weft_sync import keys
from weft_sync.codec import decode_holder
from weft_sync.errors import ClosedError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership import Ownership
from weft_sync.storage import Condition, Put, SqliteStorage, sqlite_fork
from weft_sync.storage.sqlite_writer import SqliteWriter, WriteRequest

TABLE = "kv"

pytestmark = [
    # Python 3.12+ warns when a process with threads forks; these tests fork on purpose.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()"),
]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[SqliteStorage]:
    with SqliteStorage(db_path, table=TABLE) as opened:
        yield opened


@pytest.fixture
def armed() -> Iterator[threading.Event]:
    """The event the next fork sets before the library's own fork handlers run."""
    with armed_fork() as requested:
        yield requested


def _child_writes_through_its_own_storage(inherited: SqliteStorage, path: Path) -> None:
    """The child's checks: the inherited storage refuses, a fresh one on the file writes."""
    for use in (lambda: inherited.get("k"), lambda: inherited.put("k", b"v")):
        with pytest.raises(ClosedError, match=r"inherited across os\.fork\(\)"):
            use()
    inherited.close()
    with SqliteStorage(path, table=TABLE, busy_timeout_ms=2000) as own:
        assert own.conditional_batch([Condition("child", None)], [Put("child", b"1")])
        assert own.get("child") == b"1"
        assert own.conditional_batches([([Condition("child", b"1")], [Put("child", b"2")])]) == [
            True
        ]


class _PausedWrite:
    """Pause the first write request of ``writer`` inside its transaction until released.

    At the pause the thread holds the flock and SQLite's write lock (``BEGIN IMMEDIATE`` ran and
    the first statement of the request has not).
    """

    def __init__(self, writer: SqliteWriter, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        original = writer._apply_request

        def apply(conn: sqlite3.Connection, request: WriteRequest) -> Any:
            if not self.entered.is_set():
                assert conn.in_transaction
                self.entered.set()
                assert self.release.wait(timeout=30)
            return original(conn, request)

        monkeypatch.setattr(writer, "_apply_request", apply)


def _release_when_fork_requested(armed: threading.Event, release: threading.Event) -> Any:
    helper = threading.Thread(
        target=lambda: (armed.wait(timeout=30), release.set()), name="fork-release"
    )
    helper.start()
    return helper


def _assert_flock_held(path: Path) -> None:
    fd = os.open(f"{path}.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def _writer(store: SqliteStorage) -> SqliteWriter:
    assert store._writer is not None
    return store._writer


def _integrity(path: Path) -> str:
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        return str(raw.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        raw.close()


@pytest.mark.parametrize("contended", [False, True], ids=["own-commit", "group-commit"])
def test_a_fork_during_an_open_write_transaction_leaves_the_child_a_working_store(
    store: SqliteStorage,
    db_path: Path,
    tmp_path: Path,
    armed: threading.Event,
    monkeypatch: pytest.MonkeyPatch,
    contended: bool,
) -> None:
    store.put("before", b"v")  # the parent has its write connection
    paused = _PausedWrite(_writer(store), monkeypatch)
    results: list[object] = []

    def write(key: str) -> None:
        try:
            results.append(store.conditional_batch([Condition(key, None)], [Put(key, b"p")]))
        except BaseException as exc:
            results.append(exc)

    writers = [threading.Thread(target=write, args=("parent-0",), name="w0")]
    writers[0].start()
    assert paused.entered.wait(timeout=10)  # flock and write lock held, transaction open
    _assert_flock_held(db_path)
    if contended:
        # Queued behind the open transaction: the writer thread commits them as one group.
        writers += [
            threading.Thread(target=write, args=(f"parent-{i}",), name=f"w{i}") for i in range(1, 4)
        ]
        for thread in writers[1:]:
            thread.start()
        deadline = time.monotonic() + 10
        while store._queue.qsize() < 3:
            assert time.monotonic() < deadline, "the requests were not queued"
            time.sleep(0.001)
    helper = _release_when_fork_requested(armed, paused.release)
    report = tmp_path / "child.txt"
    try:
        pid = fork_child(lambda: _child_writes_through_its_own_storage(store, db_path), report)
        wait_child(pid, report)
    finally:
        paused.release.set()
        helper.join(timeout=30)
        for thread in writers:
            thread.join(timeout=30)

    assert armed.is_set()
    assert results == [True] * len(writers)
    assert store.get("child") == b"2"
    assert [k for k, _ in store.scan("parent-")] == [f"parent-{i}" for i in range(len(writers))]
    assert _integrity(db_path) == "ok"


def test_a_write_that_outlasts_the_fork_wait_is_left_to_the_parent_and_reported_in_the_child(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fork, "FORK_GRACE_S", 0.05)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("weft_sync.storage.sqlite")
    logger.addHandler(handler)
    store = SqliteStorage(db_path, table=TABLE, busy_timeout_ms=50)
    try:
        store.put("before", b"v")
        paused = _PausedWrite(_writer(store), monkeypatch)
        results: list[object] = []
        writer = threading.Thread(
            target=lambda: results.append(store.put("parent", b"p")), name="stuck-writer"
        )
        writer.start()
        assert paused.entered.wait(timeout=10)
        report = tmp_path / "child.txt"

        def child() -> None:
            with pytest.raises(ClosedError, match=r"inherited across os\.fork\(\)"):
                store.get("before")
            assert any("was still running" in r.getMessage() for r in records), records

        try:
            wait_child(fork_child(child, report), report)
        finally:
            paused.release.set()
            writer.join(timeout=30)
        assert results == [None]
        assert store.get("parent") == b"p"
        store.put("after", b"v")
        assert [k for k, _ in store.scan()] == ["after", "before", "parent"]
    finally:
        store.close()
        logger.removeHandler(handler)


class _PausingConnection:
    """A read connection that pauses after its first ``BEGIN`` until released."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        cursor = self.conn.execute(sql, *args)
        if sql == "BEGIN" and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(timeout=30)
        return cursor

    def close(self) -> None:
        self.conn.close()


def test_a_fork_during_an_open_read_transaction_leaves_the_child_a_working_store(
    store: SqliteStorage, db_path: Path, tmp_path: Path, armed: threading.Event
) -> None:
    store.put("k", b"v")
    reads: list[object] = []
    ready = threading.Event()

    def read() -> None:
        reader = store._readers.for_thread()
        assert reader.conn is not None
        pausing = _PausingConnection(reader.conn)
        reader.conn = pausing  # type: ignore[assignment]
        ready.set()
        reads.append(pausing)
        reads.append(store.get_many(["k", "absent"]))

    thread = threading.Thread(target=read, name="reader")
    thread.start()
    assert ready.wait(timeout=10)
    pausing = reads[0]
    assert isinstance(pausing, _PausingConnection)
    assert pausing.entered.wait(timeout=10)  # a read transaction is open in the parent
    helper = _release_when_fork_requested(armed, pausing.release)
    report = tmp_path / "child.txt"
    try:
        pid = fork_child(lambda: _child_writes_through_its_own_storage(store, db_path), report)
        wait_child(pid, report)
    finally:
        pausing.release.set()
        helper.join(timeout=30)
        thread.join(timeout=30)
    assert reads[1] == [b"v", None]
    assert store.get("child") == b"2"


class _PausingClose:
    """A read connection whose ``close`` waits until released, then closes."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.entered = threading.Event()
        self.release = threading.Event()

    def close(self) -> None:
        self.entered.set()
        assert self.release.wait(timeout=30)
        self.conn.close()


def test_a_fork_waits_for_a_read_connection_being_closed(
    store: SqliteStorage, db_path: Path, tmp_path: Path, armed: threading.Event
) -> None:
    # A reader is closed when its thread has ended (or with its storage); a child forked
    # half-way through that close would inherit SQLite's lock bookkeeping for the file
    # half-updated, and its own connections could then find the file "locked" for ever.
    ready = threading.Event()
    readers: list[Any] = []

    def read() -> None:
        assert store.get("absent") is None
        readers.append(store._readers.for_thread())
        ready.set()

    thread = threading.Thread(target=read, name="reader")
    thread.start()
    assert ready.wait(timeout=10)
    thread.join(timeout=10)
    reader = readers[0]
    real = reader.conn
    pausing = _PausingClose(real)
    reader.conn = pausing
    closer = threading.Thread(target=reader.close, name="closer")
    closer.start()
    assert pausing.entered.wait(timeout=10)
    helper = _release_when_fork_requested(armed, pausing.release)
    report = tmp_path / "child.txt"

    def child() -> None:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            real.execute("SELECT 1")  # the fork came after the close, not during it
        _child_writes_through_its_own_storage(store, db_path)

    try:
        wait_child(fork_child(child, report), report)
    finally:
        pausing.release.set()
        helper.join(timeout=30)
        closer.join(timeout=30)
    assert armed.is_set()
    assert store.get("child") == b"2"


def test_two_threads_forking_at_once_each_get_a_child_with_a_working_store(
    store: SqliteStorage, db_path: Path, tmp_path: Path
) -> None:
    store.put("before", b"v")
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_writing() -> None:
        try:
            n = 0
            while not stop.wait(0.001):
                store.put(f"parent-{n % 10}", b"p")
                n += 1
        except BaseException as exc:
            errors.append(exc)

    barrier = threading.Barrier(2)
    pids: dict[int, int] = {}

    def fork(index: int) -> None:
        report = tmp_path / f"child-{index}.txt"

        def child() -> None:
            with SqliteStorage(db_path, table=TABLE, busy_timeout_ms=2000) as own:
                assert own.conditional_batch(
                    [Condition(f"c{index}", None)], [Put(f"c{index}", b"1")]
                )

        barrier.wait(timeout=10)
        pids[index] = fork_child(child, report)

    writer = threading.Thread(target=keep_writing, name="parent-writer")
    writer.start()
    forkers = [threading.Thread(target=fork, args=(i,), name=f"forker-{i}") for i in range(2)]
    try:
        for thread in forkers:
            thread.start()
        for thread in forkers:
            thread.join(timeout=30)
        for index, pid in pids.items():
            wait_child(pid, tmp_path / f"child-{index}.txt")
    finally:
        stop.set()
        writer.join(timeout=30)
    for exc in errors:
        raise exc
    assert sorted(pids) == [0, 1]
    assert (store.get("c0"), store.get("c1")) == (b"1", b"1")
    store.put("after", b"v")
    assert _integrity(db_path) == "ok"


def test_the_child_closing_its_inherited_copies_leaves_the_parents_wal_in_place(
    store: SqliteStorage, db_path: Path, tmp_path: Path
) -> None:
    for i in range(20):
        store.put(f"k{i}", b"v")  # in the write-ahead log, not yet checkpointed
    assert store.get("k0") == b"v"
    wal = Path(f"{db_path}-wal")
    size = wal.stat().st_size
    report = tmp_path / "child.txt"
    # The fork handler closed every inherited connection before this body runs.
    wait_child(fork_child(lambda: None, report), report)
    assert wal.exists() and wal.stat().st_size >= size
    store.put("after", b"v")
    raw = sqlite3.connect(db_path, isolation_level=None)
    try:
        count = raw.execute(f'SELECT count(*) FROM "{TABLE}"').fetchone()[0]
    finally:
        raw.close()
    assert count == 21


def test_a_childs_writes_stay_visible_after_the_parent_closes_the_file(
    store: SqliteStorage, db_path: Path, tmp_path: Path
) -> None:
    # Were the child's connections to share the inherited copies' lock bookkeeping, the child
    # would hold no operating-system lock: the parent's close would checkpoint and delete the
    # write-ahead log under the child, and the child's later writes would reach nobody.
    store.put("parent", b"v")
    assert store.get("parent") == b"v"
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    report = tmp_path / "child.txt"

    def child() -> None:
        with SqliteStorage(db_path, table=TABLE) as own:
            own.put("child-0", b"1")
            os.write(to_parent_w, b"1")
            assert os.read(to_child_r, 1) == b"1"  # the parent has closed its storage
            for i in range(1, 5):
                own.put(f"child-{i}", b"1")
            assert len(own.scan("child-")) == 5

    pid = fork_child(child, report)
    try:
        assert os.read(to_parent_r, 1) == b"1"
        store.close()
        os.write(to_child_w, b"1")
        wait_child(pid, report)
    finally:
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)
    with SqliteStorage(db_path, table=TABLE) as third:
        assert [k for k, _ in third.scan("child-")] == [f"child-{i}" for i in range(5)]
    assert _integrity(db_path) == "ok"


# -- the fork loop ----------------------------------------------------------------------------

FORKS = 200
# A host forking helper processes: the parent keeps its maintenance through the forks.
LOOP_OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=100, on_fork="continue")
PARENT_WORKFLOWS = 5


def _child_start_and_complete(url: str, index: int) -> None:
    with Ownership.open(url, options=LOOP_OPTIONS, background="manual") as own:
        wid = f"child-{index}"
        own.workflows.start(wid, "job")
        own.workflows.complete(wid, index)


def test_two_hundred_children_forked_while_the_parent_writes_each_write_at_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "loop.db"
    # NORMAL spares an fsync per commit; the locking under test is the same.
    url = f"sqlite:///{path}?synchronous=NORMAL"
    sink = WarningSink()
    parent = Ownership.open(url, options=LOOP_OPTIONS, warn=sink, engine_id="parent")
    stop = threading.Event()
    errors: list[BaseException] = []
    checkpoints = [0]
    try:
        ids = [f"parent-{i}" for i in range(PARENT_WORKFLOWS)]
        for wid in ids:
            parent.workflows.start(wid, "job")
            parent.drivers.enter(wid, 1, "the test's thread")  # driven for the whole test
        first = {wid: _expires_at(parent, wid) for wid in ids}

        def checkpoint() -> None:
            try:
                # A round of checkpoints every few milliseconds: writes are always in flight,
                # and the loop stays fast (bench/fork_loop.py writes without pause).
                while not stop.wait(0.003):
                    for wid in ids:
                        parent.workflows.save_checkpoint(wid, str(checkpoints[0]).encode())
                        checkpoints[0] += 1
            except BaseException as exc:
                errors.append(exc)

        writer = threading.Thread(target=checkpoint, name="parent-checkpoints")
        writer.start()
        try:
            for index in range(FORKS):
                report = tmp_path / f"child-{index}.txt"
                pid = fork_child(lambda i=index: _child_start_and_complete(url, i), report)
                wait_child(pid, report)
        finally:
            stop.set()
            writer.join(timeout=30)
        for exc in errors:
            raise exc

        assert sink.received == []
        assert parent.metrics.snapshot().renewal_failures == 0
        assert sorted(parent.registry.list_held_workflow_ids()) == ids
        for wid in ids:
            # Still ours, renewed while the children came and went.
            assert _holder_engine(parent, wid) == "parent"
            assert _expires_at(parent, wid) > first[wid]
        assert checkpoints[0] > FORKS
        done = parent.workflows.list(status="completed")
        assert sorted(r.workflow_id for r in done) == sorted(f"child-{i}" for i in range(FORKS))
    finally:
        stop.set()
        parent.close()


def _holder_engine(ownership: Ownership, wid: str) -> str | None:
    holder = decode_holder(ownership.storage.get(keys.workflow_owner_holder(wid)))
    return None if holder is None else holder.engine_id


def _expires_at(ownership: Ownership, wid: str) -> int:
    holder = decode_holder(ownership.storage.get(keys.workflow_owner_holder(wid)))
    assert holder is not None
    return holder.expires_at


@pytest.mark.timeout(60)  # a fork that waited the full time for the stuck storage would hang
def test_a_storage_stuck_in_a_write_does_not_stall_later_forks_or_starve_a_busy_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first fork waits the stuck storage's whole (shortened) wait; the second would wait
    # ten minutes for it if a storage stuck at the previous fork got its full wait again.
    monkeypatch.setattr(sqlite_fork, "FORK_GRACE_S", 0.05)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("weft_sync.storage.sqlite")
    logger.addHandler(handler)
    stuck_path, busy_path = tmp_path / "stuck.db", tmp_path / "busy.db"
    # The busy storage's own wait is shorter than the stuck one's: waited for one after the
    # other from the start of the fork, the busy one would be tried only once its wait was over.
    stuck = SqliteStorage(stuck_path, table=TABLE, busy_timeout_ms=500)
    busy = SqliteStorage(busy_path, table=TABLE, busy_timeout_ms=200)
    stop = threading.Event()
    writes = [0]
    paused: _PausedWrite | None = None
    threads: list[threading.Thread] = []
    try:
        stuck.put("before", b"v")
        paused = _PausedWrite(_writer(stuck), monkeypatch)
        threads.append(threading.Thread(target=stuck.put, args=("stuck", b"s"), name="stuck"))
        threads[0].start()
        assert paused.entered.wait(timeout=10)

        def write_continuously() -> None:
            while not stop.is_set():
                busy.put(f"parent-{writes[0] % 10}", str(writes[0]).encode())
                writes[0] += 1

        threads.append(threading.Thread(target=write_continuously, name="busy-writes"))
        threads[1].start()

        def child(key: str, left_to_parent: list[SqliteStorage]) -> None:
            not_paused = [r.args[1] for r in records if "was still running" in r.getMessage()]
            assert not_paused == left_to_parent, not_paused
            with SqliteStorage(busy_path, table=TABLE, busy_timeout_ms=2000) as own:
                assert own.conditional_batch([Condition(key, None)], [Put(key, b"1")])
                assert own.get(key) == b"1"

        def fork(key: str, left_to_parent: list[SqliteStorage]) -> None:
            report = tmp_path / f"{key}.txt"
            wait_child(fork_child(lambda: child(key, left_to_parent), report), report)

        # Only the stuck storage is left to the parent; the busy one is paused every time.
        fork("child-0", [stuck])
        assert stuck._fork_stuck
        monkeypatch.setattr(sqlite_fork, "FORK_GRACE_S", 600.0)
        for index in (1, 2):
            fork(f"child-{index}", [stuck])
            assert stuck._fork_stuck
        # Once its write has finished, the stuck storage is paused again.
        paused.release.set()
        threads[0].join(timeout=30)
        assert stuck.get("stuck") == b"s"
        fork("child-3", [])
        assert not stuck._fork_stuck
        assert writes[0] > 0
        assert [k for k, _ in busy.scan("child-")] == [f"child-{i}" for i in range(4)]
    finally:
        stop.set()
        if paused is not None:
            paused.release.set()
        for thread in threads:
            thread.join(timeout=30)
        logger.removeHandler(handler)
        stuck.close()
        busy.close()
