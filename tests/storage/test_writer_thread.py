"""The SQLite writer thread outlives whatever a request it commits raises.

A ``read_then_write`` queued behind another caller's transaction is committed by the writer
thread; its ``decide`` may raise a ``BaseException`` (``read_then_write`` lets what ``decide``
raises propagate to its caller). The caller gets it; the thread goes on taking the requests
queued after it, which would otherwise wait for good.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_set, wait_until
from weft_sync.storage import SqliteStorage


class Abort(BaseException):
    """What a decide may raise: read_then_write says 'what decide raises propagates'."""


def _hold_a_fast_commit(store: SqliteStorage, key: str) -> tuple[threading.Thread, threading.Event]:
    """Start a read_then_write committed on its own thread whose decide waits for an event."""
    entered, release = threading.Event(), threading.Event()

    def decide(values: list[bytes | None]) -> None:
        entered.set()
        assert release.wait(30)

    thread = threading.Thread(target=store.read_then_write, args=([key], decide), daemon=True)
    thread.start()
    wait_set(entered, "the caller's own transaction started")
    return thread, release


def _start_aborting(store: SqliteStorage, errors: list[BaseException]) -> threading.Thread:
    """Start a ``read_then_write`` whose decide raises :class:`Abort`; its error goes to
    ``errors``."""

    def aborting() -> None:
        def decide(values: list[bytes | None]) -> None:
            raise Abort("a decide that aborts")

        try:
            store.read_then_write(["b"], decide)
        except BaseException as exc:
            errors.append(exc)

    aborter = threading.Thread(target=aborting, daemon=True)
    aborter.start()
    return aborter


def test_a_decide_raising_baseexception_on_the_writer_thread_leaves_it_draining_the_queue(
    tmp_path: Path,
) -> None:
    store = SqliteStorage(tmp_path / "s.db", table="kv")
    try:
        # 1. A caller commits on its own thread (holds the transaction lock) ...
        holder, release = _hold_a_fast_commit(store, "a")
        # 2. ... so this read_then_write is queued for the writer thread; its decide raises.
        errors: list[BaseException] = []
        aborter = _start_aborting(store, errors)
        wait_until(lambda: store._queue.qsize() == 1, "the aborting request is queued")
        release.set()
        holder.join(10)
        aborter.join(10)
        assert len(errors) == 1 and isinstance(errors[0], Abort)  # its caller got its error
        writer = store._writer
        assert writer is not None
        # The writer thread took that request and gave its caller the error; it stays up.
        assert writer.is_alive()

        # 3. Later, ordinary writes: one caller commits on its own thread, another is queued.
        holder2, release2 = _hold_a_fast_commit(store, "c")
        done = threading.Event()

        def put() -> None:
            store.put("d", b"1")
            done.set()

        putter = threading.Thread(target=put, daemon=True)
        putter.start()
        wait_until(lambda: store._queue.qsize() == 1, "the put is queued")
        release2.set()
        holder2.join(10)
        writer_alive = writer.is_alive()
        # The queued put waits for a writer thread that no longer exists.
        assert done.wait(2.0), (
            f"the queued put never finished (writer thread alive: {writer_alive}; "
            f"queued: {store._queue.qsize()})"
        )
    finally:
        store.close(timeout=2)


def test_an_interrupt_right_after_the_fast_path_took_the_lock_gives_the_lock_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``KeyboardInterrupt`` (Ctrl-C in a REPL, which then goes on) landing after a caller
    took the transaction lock and before its commit began leaves the store writable."""
    import weft_sync.storage.sqlite.store as store_module
    from weft_sync.storage.sqlite.writer import WriteRequest

    interrupted: list[bool] = []

    class InterruptedOnce(WriteRequest):
        def __init__(self, *args: Any, queued: bool = True, **kwargs: Any) -> None:
            if not queued and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            super().__init__(*args, queued=queued, **kwargs)

    store = SqliteStorage(tmp_path / "s.db", table="kv")
    try:
        store.put("a", b"1")  # the writer thread exists; the next put takes the fast path
        monkeypatch.setattr(store_module, "WriteRequest", InterruptedOnce)
        with pytest.raises(KeyboardInterrupt):
            store.put("b", b"2")
        assert interrupted == [True]
        done = threading.Event()

        def put() -> None:
            store.put("c", b"3")
            done.set()

        putter = threading.Thread(target=put, daemon=True)
        putter.start()
        wait_set(done, "a write after the interrupted one")
        putter.join(10)
        assert store.get("b") is None and store.get("c") == b"3"
    finally:
        store.close(timeout=2)


def test_a_baseexception_of_one_decide_is_its_own_and_the_rest_of_its_group_commits(
    tmp_path: Path,
) -> None:
    store = SqliteStorage(tmp_path / "s.db", table="kv")
    try:
        holder, release = _hold_a_fast_commit(store, "a")
        aborter_errors: list[BaseException] = []
        putter_errors: list[BaseException] = []

        def putting() -> None:
            try:
                store.put("unrelated", b"value")
            except BaseException as exc:
                putter_errors.append(exc)

        aborter = _start_aborting(store, aborter_errors)
        wait_until(lambda: store._queue.qsize() == 1, "the aborting request is queued")
        putter = threading.Thread(target=putting, daemon=True)
        putter.start()
        wait_until(lambda: store._queue.qsize() == 2, "the unrelated put is queued")
        release.set()
        holder.join(10)
        aborter.join(10)
        putter.join(10)
        assert len(aborter_errors) == 1 and isinstance(aborter_errors[0], Abort)
        assert putter_errors == [], (
            f"the unrelated put raised {putter_errors!r}: another thread's decide's BaseException"
        )
        assert store.get("unrelated") == b"value"
    finally:
        store.close(timeout=2)
