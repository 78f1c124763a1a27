"""The handler executor: a hung handler never holds up a run queued after it.

Runs real threads of a real :class:`HandlerExecutor`; the handlers are plain functions that
finish at once or wait on an event the test sets at the end.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.waiting import wait_set, wait_until
from weft_sync.clock import ManualClock
from weft_sync.metrics import ClaimMetrics
from weft_sync.ownership.handler_executor import HandlerExecutor


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown, so that a hung handler of a failed test still ends."""
    event = threading.Event()
    yield event
    event.set()


def _executor(workers: int) -> HandlerExecutor:
    return HandlerExecutor(
        workers,
        engine_id="engine-test",
        clock=ManualClock(1_000),
        stuck_after_ms=None,
        metrics=ClaimMetrics(),
    )


def _waiting(thread: threading.Thread, caller: Any = HandlerExecutor._work) -> bool:
    """Whether ``thread`` is blocked in a ``Condition.wait`` called by ``caller`` (by default:
    a handler thread waiting for work)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return frame.f_back is not None and frame.f_back.f_code is caller.__code__
        frame = frame.f_back
    return False


def test_a_run_queued_right_after_a_hanging_one_gets_a_thread_of_its_own(
    release: threading.Event,
) -> None:
    executor = _executor(workers=4)
    try:
        # One handler thread exists and waits for work.
        first = executor.submit("wf-first", "job", lambda: None)
        wait_set(first.done, "the first run finished")
        (thread,) = [t for t in threading.enumerate() if t.name.startswith("weft-handler-")]
        wait_until(lambda: _waiting(thread), "the handler thread waits for work")
        # Two runs back to back: the woken thread takes the first, which hangs.
        hanging = threading.Event()

        def hang() -> None:
            hanging.set()
            release.wait(30)

        executor.submit("wf-hang", "hang", hang)
        after = executor.submit("wf-after", "job", lambda: None)
        wait_set(hanging, "the hanging handler started")
        wait_set(after.done, "the run queued after the hanging one finished")
        assert [run.workflow_id for run in executor.running()] == ["wf-hang"]
    finally:
        release.set()
        assert executor.close(timeout=5.0) == []


def test_hung_handlers_on_all_but_one_thread_leave_every_other_run_to_it(
    release: threading.Event,
) -> None:
    executor = _executor(workers=4)
    started: list[int] = []

    def hang() -> None:
        release.wait(30)

    try:
        runs = []
        for i in range(12):
            if i in (0, 4, 8):
                runs.append(executor.submit(f"wf-{i}", "hang", hang))
            else:
                runs.append(executor.submit(f"wf-{i}", "job", functools.partial(started.append, i)))
        for run in runs:
            if run.workflow_type == "job":
                wait_set(run.done, f"run {run.workflow_id} finished")
        assert sorted(started) == [i for i in range(12) if i not in (0, 4, 8)]
        assert sorted(run.workflow_id for run in executor.running()) == ["wf-0", "wf-4", "wf-8"]
        handler_threads = [t for t in threading.enumerate() if t.name.startswith("weft-handler-")]
        assert len(handler_threads) <= 4
    finally:
        release.set()
        assert executor.close(timeout=5.0) == []


def _line_after_a_run() -> int:
    """The line of ``HandlerExecutor._work`` right after a run's end was published."""
    lines, first = inspect.getsourcelines(HandlerExecutor._work)
    for offset, line in enumerate(lines):
        if line.strip() == "run.done.set()":
            return first + offset
    raise AssertionError("no run.done.set() in HandlerExecutor._work")


def test_a_run_submitted_while_run_maintenance_waits_reaches_the_idle_thread(
    release: threading.Event,
) -> None:
    """``wait_idle()`` (``run_maintenance``) waits while handlers run; when a run ends, its
    caller wakes and waits again, maybe before the thread that ran it: a run submitted then
    must still reach that idle thread, not the waiting caller."""
    executor = _executor(workers=2)
    after_run, code = _line_after_a_run(), HandlerExecutor._work.__code__
    hold_back = threading.Event()

    def local(frame: Any, event: str, arg: object) -> Any:
        if event == "line" and frame.f_lineno == after_run and hold_back.is_set():
            time.sleep(0.05)  # the woken wait_idle() caller waits again first
        return local

    def global_trace(frame: Any, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    hanging, short_started, short_go = threading.Event(), threading.Event(), threading.Event()

    def hang() -> None:
        hanging.set()
        release.wait(30)

    def short() -> None:
        short_started.set()
        short_go.wait(30)

    threading.settrace(global_trace)
    try:
        executor.submit("wf-hang", "hang", hang)
        short_run = executor.submit("wf-short", "job", short)
        wait_set(hanging, "the hanging handler started")
        wait_set(short_started, "the short handler started")
    finally:
        threading.settrace(None)
    try:
        waiter = threading.Thread(target=executor.wait_idle, args=(30,), daemon=True)
        waiter.start()
        wait_until(lambda: _waiting(waiter, HandlerExecutor.wait_idle), "wait_idle() waits")
        hold_back.set()
        short_go.set()
        short_thread = short_run.thread
        assert short_thread is not None
        wait_until(lambda: _waiting(short_thread), "the short handler's thread is idle")
        hold_back.clear()
        after = executor.submit("wf-after", "job", lambda: None)
        wait_set(after.done, "the run submitted while a handler thread was idle finished")
    finally:
        release.set()
        assert executor.close(timeout=5.0) == []


def test_a_handler_thread_that_fails_to_start_gives_its_run_back_and_counts_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``can't start new thread`` (a thread limit): ``submit`` raises, the run is not queued,
    and a later submit starts a thread of its own and runs."""
    executor = _executor(workers=1)
    real_start = threading.Thread.start
    failed = threading.Event()

    def start_once_failing(self: threading.Thread) -> None:
        if self.name.startswith("weft-handler-") and not failed.is_set():
            failed.set()
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    ran, never = threading.Event(), threading.Event()
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            executor.submit("wf-1", "job", never.set)
        later = executor.submit("wf-2", "job", ran.set)
        wait_set(ran, "the run submitted after the failed start")
        wait_set(later.done, "that run finished")
        assert executor.wait_idle(5.0)
        assert not never.is_set()  # the run given back is not run behind the caller's back
    finally:
        assert executor.close(timeout=5.0) == []
