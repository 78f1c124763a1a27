"""Fork safety on SQLite: a fork never waits, and the child's own store works when it can.

A fork never waits for the library. In the child, the inherited storage raises ``ClosedError``;
when no thread of the library was inside SQLite at the fork, the child closes the connections it
inherited, so its own storage on the same file starts from clean lock bookkeeping and holds real
operating-system locks. When one was (a write or read in flight), the child leaves every
inherited connection untouched and logs why. Children report through their exit code and a
traceback file, and leave with ``os._exit``.
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
from tests.forking import CHILD_DEADLINE_S, fork_child, wait_child
from weft_sync import _fork, keys
from weft_sync.codec import decode_holder
from weft_sync.errors import ClosedError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Condition, Put, SqliteStorage
from weft_sync.storage.sqlite.writer import SqliteWriter, WriteRequest

TABLE = "kv"

pytestmark = [
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
def sqlite_log() -> Iterator[list[logging.LogRecord]]:
    """The records the SQLite backend logs (in the child too: a forked copy of the list)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("weft_sync.storage.sqlite.store")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


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

        def apply(conn: sqlite3.Connection, request: WriteRequest, isolate: bool) -> Any:
            if not self.entered.is_set():
                assert conn.in_transaction
                self.entered.set()
                assert self.release.wait(timeout=30)
            return original(conn, request, isolate)

        monkeypatch.setattr(writer, "_apply_request", apply)


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


def _refuses_inherited(inherited: SqliteStorage) -> None:
    for use in (lambda: inherited.get("k"), lambda: inherited.put("k", b"v")):
        with pytest.raises(ClosedError, match=r"inherited across os\.fork\(\)"):
            use()


def _busy_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if "inside SQLite" in r.getMessage()]


def test_an_idle_storage_is_closed_in_the_child_which_writes_through_its_own(
    store: SqliteStorage, db_path: Path, tmp_path: Path, sqlite_log: list[logging.LogRecord]
) -> None:
    store.put("before", b"v")  # the parent has its write connection and a reader
    assert store.get("before") == b"v"
    report = tmp_path / "child.txt"

    inherited = _writer(store)._conn
    assert inherited is not None

    def child() -> None:
        assert _busy_warnings(sqlite_log) == []  # nothing was in use: the copies were closed
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            inherited.execute("SELECT 1")
        _child_writes_through_its_own_storage(store, db_path)

    wait_child(fork_child(child, report), report)
    assert store.get("child") == b"2"
    store.put("after", b"v")
    assert _integrity(db_path) == "ok"


def test_a_fork_during_a_write_does_not_wait_for_it_and_the_child_leaves_the_copies_alone(
    store: SqliteStorage,
    db_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sqlite_log: list[logging.LogRecord],
) -> None:
    store.put("before", b"v")
    paused = _PausedWrite(_writer(store), monkeypatch)
    results: list[object] = []
    writer = threading.Thread(
        target=lambda: results.append(store.put("parent", b"p")), name="paused-writer"
    )
    writer.start()
    assert paused.entered.wait(timeout=10)  # flock and write lock held, transaction open
    _assert_flock_held(db_path)
    report = tmp_path / "child.txt"
    inherited = _writer(store)._conn

    def child() -> None:
        _refuses_inherited(store)
        assert len(_busy_warnings(sqlite_log)) == 1, sqlite_log
        # Left as it was (pinned): no SQLite call runs on a connection a thread was inside.
        assert any(kept is inherited for kept in _fork._PINNED)

    try:
        began = time.monotonic()
        pid = fork_child(child, report)
        forked_in = time.monotonic() - began
        wait_child(pid, report)
        # The write stays paused until after the child is done: the fork did not wait for it.
        assert not paused.release.is_set() and writer.is_alive()
        assert forked_in < 1.0
    finally:
        paused.release.set()
        writer.join(timeout=30)
    assert results == [None]
    assert store.get("parent") == b"p"
    store.put("after", b"v")
    assert [k for k, _ in store.scan()] == ["after", "before", "parent"]
    assert _integrity(db_path) == "ok"


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


def test_a_fork_during_a_read_leaves_the_copies_alone_and_the_child_still_writes(
    store: SqliteStorage, db_path: Path, tmp_path: Path, sqlite_log: list[logging.LogRecord]
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
    report = tmp_path / "child.txt"

    def child() -> None:
        assert len(_busy_warnings(sqlite_log)) == 1, sqlite_log
        # A read holds no write lock: the child's own storage can still write.
        _child_writes_through_its_own_storage(store, db_path)

    try:
        wait_child(fork_child(child, report), report)
        assert not pausing.release.is_set()  # the read stayed open across the whole fork
    finally:
        pausing.release.set()
        thread.join(timeout=30)
    assert reads[1] == [b"v", None]
    assert store.get("child") == b"2"
    assert _integrity(db_path) == "ok"


def test_two_threads_forking_at_once_each_get_a_child_with_a_working_store(
    store: SqliteStorage, db_path: Path, tmp_path: Path
) -> None:
    store.put("before", b"v")
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

    forkers = [threading.Thread(target=fork, args=(i,), name=f"forker-{i}") for i in range(2)]
    for thread in forkers:
        thread.start()
    for thread in forkers:
        thread.join(timeout=30)
    for index, pid in pids.items():
        wait_child(pid, tmp_path / f"child-{index}.txt")
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
    # The parent forks from its writing thread and runs its own maintenance (manual): no thread
    # of the library is inside SQLite at any fork, and the parent writes and renews while every
    # child runs (see bench/fork_loop.py).
    path = tmp_path / "loop.db"
    # NORMAL spares an fsync per commit; the locking under test is the same.
    url = f"sqlite:///{path}?synchronous=NORMAL"
    sink = WarningSink()
    parent = Ownership.open(
        url, options=LOOP_OPTIONS, warn=sink, engine_id="parent", background="manual"
    )
    checkpoints = 0
    try:
        ids = [f"parent-{i}" for i in range(PARENT_WORKFLOWS)]
        for wid in ids:
            parent.workflows.start(wid, "job")
            parent.drivers.enter(wid, 1, "the test's thread")  # driven for the whole test
        first = {wid: _expires_at(parent, wid) for wid in ids}
        renewed_at = time.monotonic()
        for index in range(FORKS):
            report = tmp_path / f"child-{index}.txt"
            pid = fork_child(lambda i=index: _child_start_and_complete(url, i), report)
            deadline = time.monotonic() + CHILD_DEADLINE_S
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    wait_child(pid, report, deadline_s=0.0)  # kills it, failing with its stacks
                for wid in ids:
                    parent.workflows.save_checkpoint(wid, str(checkpoints).encode())
                    checkpoints += 1
                if time.monotonic() - renewed_at >= LOOP_OPTIONS.claim_renew_interval_ms / 1000:
                    parent.run_maintenance()
                    renewed_at = time.monotonic()
            details = report.read_text() if report.exists() else ""
            assert os.waitstatus_to_exitcode(done[1]) == 0, details

        assert sink.received == []
        assert parent.metrics.snapshot().renewal_failures == 0
        assert sorted(parent.registry.list_held_workflow_ids()) == ids
        for wid in ids:
            # Still ours, renewed while the children came and went.
            assert _holder_engine(parent, wid) == "parent"
            assert _expires_at(parent, wid) > first[wid]
        assert checkpoints > FORKS
        done = parent.workflows.list(status="completed")
        assert sorted(r.workflow_id for r in done) == sorted(f"child-{i}" for i in range(FORKS))
    finally:
        parent.close()


def _holder_engine(ownership: Ownership, wid: str) -> str | None:
    holder = decode_holder(ownership.storage.get(keys.workflow_owner_holder(wid)))
    return None if holder is None else holder.engine_id


def _expires_at(ownership: Ownership, wid: str) -> int:
    holder = decode_holder(ownership.storage.get(keys.workflow_owner_holder(wid)))
    assert holder is not None
    return holder.expires_at
