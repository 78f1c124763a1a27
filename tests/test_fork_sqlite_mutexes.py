"""Fork safety on SQLite: no child inherits one of SQLite's process-wide mutexes held.

Threads that are not the library's use SQLite while the main thread forks: they open and close
their own connections, leave connections to the garbage collector, or hold one of SQLite's
static mutexes (through the same library, with ``ctypes``) at the moment of the fork. Every
child must close what it inherited and write through its own storage within a bounded time; a
child that hangs is killed and its stacks are shown.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.forking import armed_fork, fork_child, wait_child
from weft_sync.storage import SqliteStorage, sqlite_fork, sqlite_mutexes
from weft_sync.storage.sqlite_mutexes import SqliteLibrary

TABLE = "kv"
FORKS = 60
CHILD_DEADLINE_S = 5.0

pytestmark = [
    # Python 3.12+ warns when a process with threads forks; these tests fork on purpose.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()"),
]


@pytest.fixture
def lib() -> SqliteLibrary:
    found = sqlite_mutexes.library()
    if isinstance(found, str):
        pytest.skip(f"SQLite's mutexes cannot be reached here: {found}")
    return found


@pytest.fixture
def armed() -> Iterator[threading.Event]:
    """The event the next fork sets before the library's own fork handlers run."""
    with armed_fork() as requested:
        yield requested


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStorage]:
    with SqliteStorage(tmp_path / "store.db", table=TABLE, busy_timeout_ms=2000) as opened:
        opened.put("parent", b"1")
        assert opened.get("parent") == b"1"  # a read connection too, closed in each child
        yield opened


def _child_writes_its_own(path: str | Path) -> Callable[[], None]:
    def body() -> None:
        with SqliteStorage(path, table=TABLE, busy_timeout_ms=2000) as own:
            own.put("child", b"1")
            assert own.get("child") == b"1"

    return body


def _fork_and_wait(body: Callable[[], None], report: Path) -> None:
    wait_child(fork_child(body, report, CHILD_DEADLINE_S), report, CHILD_DEADLINE_S)


def _open_and_close(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("SELECT length(?)", (b"x" * 4096,)).fetchone()  # allocates inside SQLite
    conn.close()


def _leave_to_the_collector(path: Path) -> None:
    # A sqlite3.Connection is part of a reference cycle (its statement cache): unreachable, it
    # is closed by the next collection, here on this thread.
    sqlite3.connect(path).execute("SELECT 1").fetchone()
    gc.collect(0)


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the collected connections
@pytest.mark.parametrize(
    "foreign_use", [_open_and_close, _leave_to_the_collector], ids=["close", "collect"]
)
def test_children_forked_while_another_thread_uses_sqlite_never_hang(
    store: SqliteStorage, tmp_path: Path, foreign_use: Callable[[Path], None]
) -> None:
    stop = threading.Event()
    uses = [0]
    errors: list[BaseException] = []

    def use_sqlite() -> None:
        try:
            while not stop.is_set():
                foreign_use(tmp_path / "foreign.db")
                uses[0] += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=use_sqlite, name="foreign-sqlite")
    thread.start()
    try:
        for index in range(FORKS):
            _fork_and_wait(_child_writes_its_own(store.path), tmp_path / f"child-{index}.txt")
    finally:
        stop.set()
        thread.join(timeout=30)
    for exc in errors:
        raise exc
    assert uses[0] > 0
    assert store.get("child") == b"1"


class _Holder:
    """A thread that holds one of SQLite's static mutexes until released."""

    def __init__(self, lib: SqliteLibrary, mutex: int) -> None:
        self.lib, self.mutex = lib, mutex
        self.holding = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mutex-holder")
        self.thread.start()
        assert self.holding.wait(timeout=10)

    def _run(self) -> None:
        self.lib.enter(self.mutex)
        self.holding.set()
        try:
            self.release.wait(timeout=30)
        finally:
            self.lib.leave(self.mutex)

    def stop(self) -> None:
        self.release.set()
        self.thread.join(timeout=30)


def _held(lib: SqliteLibrary, name: str) -> int:
    index = list(sqlite_mutexes.HELD_ACROSS_FORK).index(name)
    return lib.held[index]


def test_a_fork_waits_for_a_thread_inside_the_unix_vfs_mutex(
    lib: SqliteLibrary, store: SqliteStorage, tmp_path: Path, armed: threading.Event
) -> None:
    holder = _Holder(lib, _held(lib, "VFS1"))

    def release_once_the_fork_has_begun() -> None:
        # A moment after the fork began: a fork that did not wait for the mutex would have
        # made the child by then, with a copy of it held for ever.
        if armed.wait(timeout=30):
            holder.release.wait(0.05)
        holder.release.set()

    helper = threading.Thread(target=release_once_the_fork_has_begun, name="release-on-fork")
    helper.start()
    try:
        _fork_and_wait(_child_writes_its_own(store.path), tmp_path / "child.txt")
    finally:
        holder.stop()
        helper.join(timeout=30)
    assert armed.is_set()
    assert store.get("child") == b"1"


def _memory_statistics_on(lib: SqliteLibrary) -> bool:
    import _sqlite3

    memory_used = ctypes.PyDLL(getattr(_sqlite3, "__file__", None)).sqlite3_memory_used
    memory_used.restype = ctypes.c_int64
    return int(memory_used()) > 0


@pytest.mark.parametrize("name", list(sqlite_mutexes.FREED_IN_CHILD))
def test_a_child_lets_go_of_a_mutex_a_parent_thread_held_at_fork(
    lib: SqliteLibrary, store: SqliteStorage, tmp_path: Path, name: str
) -> None:
    if name == "MEM" and not _memory_statistics_on(lib):
        pytest.skip("SQLite's memory statistics are off: allocations take no mutex")
    index = list(sqlite_mutexes.FREED_IN_CHILD).index(name)
    holder = _Holder(lib, lib.freed_in_child[index])
    try:
        # The parent thread holds it across the whole fork: only the child can let go of it.
        pid = fork_child(_child_writes_its_own(store.path), tmp_path / "child.txt")
    finally:
        holder.stop()
    wait_child(pid, tmp_path / "child.txt", CHILD_DEADLINE_S)
    assert store.get("child") == b"1"


def test_a_cursor_freed_with_another_threads_locals_does_not_hang_the_child(
    store: SqliteStorage, tmp_path: Path
) -> None:
    # Python frees what other threads' thread-locals held before any fork handler runs: this
    # cursor, in the middle of a read, is reset in the child then, and ends its statement.
    local = threading.local()
    ready, stop = threading.Event(), threading.Event()
    conn = sqlite3.connect(tmp_path / "foreign.db", isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE t (x)")
    conn.executemany("INSERT INTO t VALUES (?)", [(b"x" * 3000,) for _ in range(200)])

    def read_half_way() -> None:
        local.cursor = conn.execute("SELECT x FROM t")
        local.cursor.fetchone()
        ready.set()
        stop.wait(timeout=30)

    thread = threading.Thread(target=read_half_way, name="reader-with-a-local")
    thread.start()
    try:
        assert ready.wait(timeout=10)
        _fork_and_wait(_child_writes_its_own(store.path), tmp_path / "child.txt")
    finally:
        stop.set()
        thread.join(timeout=30)
        conn.close()
    assert store.get("child") == b"1"


def test_a_mutex_held_past_the_deadline_lets_the_fork_go_on_and_is_logged(
    lib: SqliteLibrary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sqlite_fork.live() == []  # no storage: the fork waits only FORK_GRACE_S
    monkeypatch.setattr(sqlite_fork, "FORK_GRACE_S", 0.05)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign,assignment]
    logger = logging.getLogger("weft_sync.storage.sqlite")
    logger.addHandler(handler)
    holder = _Holder(lib, _held(lib, "PRNG"))
    try:
        # The child uses no SQLite: it would wait for the mutex the parent thread holds.
        _fork_and_wait(lambda: None, tmp_path / "child.txt")
    finally:
        holder.stop()
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "the child may hang in SQLite" in messages[0], messages
    assert gc.isenabled()


def test_the_library_found_is_the_sqlite3_modules_own(lib: SqliteLibrary, tmp_path: Path) -> None:
    assert lib.version == sqlite3.sqlite_version
    assert len(lib.held) == len(sqlite_mutexes.HELD_ACROSS_FORK)
    # Holding its unix VFS mutex keeps the sqlite3 module from opening a file.
    holder = _Holder(lib, _held(lib, "VFS1"))
    opened = threading.Event()

    def open_one() -> None:
        sqlite3.connect(tmp_path / "x.db").close()
        opened.set()

    thread = threading.Thread(target=open_one, name="opener")
    try:
        thread.start()
        assert not opened.wait(0.2)
    finally:
        holder.stop()
    thread.join(timeout=30)
    assert opened.is_set()


def test_a_library_without_sqlites_functions_is_refused_with_the_reason() -> None:
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to load")
    reason = sqlite_mutexes.load(libc)
    assert isinstance(reason, str) and "not exported" in reason and "sqlite3_" in reason


def test_another_sqlite_version_than_the_sqlite3_modules_is_refused_naming_both() -> None:
    reason = sqlite_mutexes.load(expected_version="0.0.1")
    assert isinstance(reason, str)
    assert "0.0.1" in reason and sqlite3.sqlite_version in reason


def test_forks_without_the_library_warn_once_and_go_on_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sqlite_mutexes._library, "value", "a SQLite function is not exported (test)"
    )
    monkeypatch.setattr(sqlite_mutexes, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"cannot take SQLite's process-wide mutexes.*test"):
        first = SqliteStorage(tmp_path / "a.db", table=TABLE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with SqliteStorage(tmp_path / "b.db", table=TABLE):
                pass
        assert sqlite_mutexes.before_fork(deadline=0.0)  # nothing to take: nothing held
        sqlite_mutexes.after_fork_in_parent()
        first.put("k", b"v")
        _fork_and_wait(_child_writes_its_own(tmp_path / "a.db"), tmp_path / "child.txt")
        assert first.get("child") == b"1"
    finally:
        first.close()
