"""The client-side call deadlines: a frozen process keeps its calls, and a cancel keeps to its call.

A process stopped (``SIGSTOP``) and continued must not cancel the PostgreSQL calls it was
making when it stopped: the time it did not run is not the calls' time. And a cancel or a cut
the watcher has begun must be over before the call's block ends, so it can never reach the
statement the connection runs next, for another caller, after it went back to the pool.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from weft_sync.storage.postgres.deadline import CallDeadlines

BOUND_S = 1.5
FREEZE_S = 2.5
SLEEP_S = 3.2
"""Longer than the freeze and than the bound, shorter than the bound plus the freeze: cancelled
at the continue if the frozen time counted, finished if it did not."""

_CHILD = textwrap.dedent(
    """
    import logging
    import sys
    import psycopg
    from weft_sync.storage.postgres.deadline import CallDeadlines

    logging.basicConfig(level=logging.INFO)
    deadlines = CallDeadlines(float(sys.argv[2]), "test-deadline")
    with psycopg.connect(sys.argv[1], autocommit=True) as conn:
        print("started", flush=True)
        try:
            with deadlines.guard(conn):
                conn.execute("SELECT pg_sleep(%s)", [float(sys.argv[3])])
            print("finished", flush=True)
        except Exception as exc:
            print("failed", type(exc).__name__, exc, flush=True)
    deadlines.close()
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP is POSIX")
def test_a_stopped_and_continued_process_does_not_cancel_its_calls(
    postgres_base_url: str,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, postgres_base_url, str(BOUND_S), str(SLEEP_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started"
        time.sleep(0.3)  # the statement is in flight
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.strip() == "finished", (out, err)
    assert "did not run for" in err, err


class _PausingCancel:
    """A stand-in for a connection whose cancel takes ``pause`` seconds; it records when the
    cancel began and ended."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.began = threading.Event()
        self.ended_at: float | None = None

    def cancel_safe(self, timeout: float) -> None:
        self.began.set()
        time.sleep(self.pause)
        self.ended_at = time.monotonic()

    @property
    def pgconn(self) -> Any:  # the cut's socket: none here
        raise AttributeError("no socket")


def test_a_call_block_ends_only_once_its_cancel_is_over() -> None:
    deadlines = CallDeadlines(0.2, "test-deadline")
    conn = _PausingCancel(0.5)
    try:
        with deadlines.guard(conn):
            assert conn.began.wait(10.0), "the call past its bound got no cancel"
        left_at = time.monotonic()
    finally:
        deadlines.close()
    assert conn.ended_at is not None, "the block ended while its cancel was still under way"
    assert conn.ended_at <= left_at


def test_a_call_past_its_bound_is_still_cancelled() -> None:
    deadlines = CallDeadlines(0.2, "test-deadline")
    conn = _PausingCancel(0.0)
    started = time.monotonic()
    try:
        with deadlines.guard(conn):
            assert conn.began.wait(10.0), "the call past its bound got no cancel"
            cancelled_after = time.monotonic() - started
    finally:
        deadlines.close()
    assert 0.2 <= cancelled_after < 5.0, cancelled_after


class _RaisingHandler(logging.Handler):
    """A host log handler that fails on the watcher's cancel warning."""

    def emit(self, record: logging.LogRecord) -> None:
        if "outlived its bound" in record.getMessage():
            raise RuntimeError("a broken host log handler")


class _QuietConn:
    """Stands in for a psycopg connection whose cancel does nothing."""

    def cancel_safe(self, timeout: float) -> None:
        pass


def test_a_cancel_that_raises_leaves_the_watcher_running_and_the_call_returning() -> None:
    deadlines = CallDeadlines(0.1, "weft-pg-deadlines-test")
    logger = logging.getLogger("weft_sync.storage.postgres.deadline")
    handler = _RaisingHandler(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        for _ in range(2):  # the second call is bounded by the same watcher thread
            returned = threading.Event()

            def call(done: threading.Event = returned) -> None:
                with deadlines.guard(_QuietConn()):
                    time.sleep(0.4)  # the server answers after the bound
                done.set()

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            assert returned.wait(5.0), "the guarded call never returned"
            caller.join(5.0)
    finally:
        logger.removeHandler(handler)
        deadlines.close()


def _watcher_waiting(deadlines: CallDeadlines) -> None:
    """Wait until the watcher thread sleeps in its wait, not looking at the calls."""
    until = time.monotonic() + 10.0
    while deadlines._asleep_until is None:
        assert time.monotonic() < until, "the watcher never went back to its wait"
        time.sleep(0.005)


def test_a_call_due_before_the_watcher_wakes_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new call wakes the watcher only when its deadline comes before the watcher's own wake:
    with a long tick and a call already in flight, a call due sooner is still cancelled then."""
    monkeypatch.setattr("weft_sync.storage.postgres.deadline.TICK_S", 30.0)
    deadlines = CallDeadlines(20.0, "test-deadline")
    slow, due = _PausingCancel(0.0), _PausingCancel(0.0)
    try:
        with deadlines.guard(slow):
            _watcher_waiting(deadlines)  # a timed wait, about 20 s long
            started = time.monotonic()
            with deadlines.guard(due, since=started - 19.8):
                assert due.began.wait(10.0), "the call due first got no cancel"
                cancelled_after = time.monotonic() - started
            assert not slow.began.is_set()
    finally:
        deadlines.close()
    assert cancelled_after < 5.0, cancelled_after


def test_calls_due_after_the_watcher_wakes_leave_it_asleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls that begin while another is in flight, due after the watcher's next wake, do not
    wake it (no thread switch per call): it stays in the same wait."""
    monkeypatch.setattr("weft_sync.storage.postgres.deadline.TICK_S", 30.0)
    deadlines = CallDeadlines(20.0, "test-deadline")
    try:
        with deadlines.guard(_PausingCancel(0.0)):
            _watcher_waiting(deadlines)
            asleep_until = deadlines._asleep_until
            for _ in range(20):
                with deadlines.guard(_PausingCancel(0.0)):
                    time.sleep(0.01)
            assert deadlines._asleep_until == asleep_until
    finally:
        deadlines.close()
