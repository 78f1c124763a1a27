"""The handler executor: the engine's own bounded pool of threads that run workflow handlers.

Handlers are host code: they may be slow, block on the host's database or hang. They never run
on the maintenance threads, so renewal, reclaim and the polls go on whatever a handler does.
The executor starts its threads lazily (an engine that never drives a reclaimed workflow has
none), at most ``workers`` of them, named ``weft-handler-<engine>-<n>`` and daemon; tasks beyond
that wait in a FIFO queue.

A run that lasts longer than ``stuck_after_ms`` on the engine's clock is reported once by
:meth:`HandlerExecutor.check_stuck` (a warning in the log and
``weft_workflow_claim_handler_stuck_total{type}``); the driver check of each renewal pass calls
it. :meth:`HandlerExecutor.close` drops the queued tasks, waits for the running ones up to its
timeout and abandons those still running with one warning each: a Python thread cannot be
stopped, so an abandoned handler keeps running, but its engine is closed under it (its writes
raise ``ClosedError`` or are refused by the fence once its claim is released or taken over).

In a child process that inherited the executor across ``os.fork()`` no thread of the parent
exists: :meth:`submit` refuses and :meth:`close` does nothing.

The executor has one lock, guarding the queue, the thread list, the running runs and the closed
flag, with two conditions on it: handler threads wait on one for work, :meth:`wait_idle` on the
other for runs to end. Handlers and logging run outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

from ..clock import Clock
from ..errors import ClosedError
from ..metrics import ClaimMetrics

_log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class HandlerRun:
    """One handler call: queued, then running on a handler thread, then done."""

    workflow_id: str
    workflow_type: str
    body: Callable[[], object]
    started_at: int | None = None
    thread: threading.Thread | None = None
    warned: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class HandlerExecutor:
    """Runs handler calls on at most ``workers`` named daemon threads of their own.

    :param workers: the most handler calls running at once.
    :param engine_id: names the threads.
    :param clock: the engine's clock (measures how long a run has been going).
    :param stuck_after_ms: a run going longer than this is reported stuck; ``None``: never.
    :param metrics: counts stuck runs.
    """

    def __init__(
        self,
        workers: int,
        *,
        engine_id: str,
        clock: Clock,
        stuck_after_ms: int | None,
        metrics: ClaimMetrics,
    ) -> None:
        self._workers = workers
        self._name = f"weft-handler-{engine_id[:8]}"
        self._clock = clock
        self._stuck_after_ms = stuck_after_ms
        self._metrics = metrics
        self._pid = os.getpid()
        self._numbers = count(1)
        # The executor's one lock, shared by both conditions, guards _queue, _threads, _idle,
        # _running and _closed. Handler threads wait on _cond for work; wait_idle() waits on
        # _settled, so that a submit's notify() always reaches a handler thread.
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._settled = threading.Condition(lock)
        self._queue: deque[HandlerRun] = deque()
        self._threads: list[threading.Thread] = []
        # Threads that will take a queued run without being started: waiting, woken but not yet
        # holding the lock again, or started and not yet at their first wait.
        self._idle = 0
        self._running: list[HandlerRun] = []
        self._closed = False

    def submit(
        self, workflow_id: str, workflow_type: str, body: Callable[[], object]
    ) -> HandlerRun:
        """Queue ``body`` to run on a handler thread; return its run (``run.done`` is set after).

        ``body`` must handle its own exceptions; one that escapes is logged.

        :raises ClosedError: the executor was closed, or this process inherited it across a fork.
        """
        run = HandlerRun(workflow_id, workflow_type, body)
        thread: threading.Thread | None = None
        with self._cond:
            if self._closed or self._pid != os.getpid():
                raise ClosedError(
                    f"the handler executor of {self._name} is closed; workflow {workflow_id!r} "
                    f"is not driven here"
                )
            self._queue.append(run)
            # Every queued run needs an idle thread of its own: a thread woken for an earlier
            # run still counts as idle until it takes that run, and if that run hangs, a run
            # counted on the same thread would wait behind it.
            if self._idle < len(self._queue) and len(self._threads) < self._workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{next(self._numbers)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
            else:
                self._cond.notify()
        if thread is not None:
            try:
                thread.start()
            except RuntimeError:
                # "can't start new thread" (a thread limit; an interrupt in start() is not this
                # and goes on as it is): the thread counts nowhere, so the next submit starts
                # another, and the run is taken back unless a thread that came free took it.
                with self._cond:
                    self._threads.remove(thread)
                    self._idle -= 1
                    taken = run not in self._queue
                    if not taken:
                        self._queue.remove(run)
                if not taken:
                    raise
                _log.warning(
                    "could not start a handler thread for workflow %r; it runs on a thread "
                    "that came free",
                    workflow_id,
                    exc_info=True,
                )
        return run

    def is_handler_thread(self) -> bool:
        """Whether the calling thread is one of this executor's handler threads."""
        current = threading.current_thread()
        with self._cond:
            return current in self._threads

    def running(self) -> list[HandlerRun]:
        """The runs going on right now."""
        with self._cond:
            return list(self._running)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until nothing is queued or running; return whether it came to that in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._settled.wait(remaining)
        return True

    def check_stuck(self) -> list[HandlerRun]:
        """Report each run past ``stuck_after_ms`` once; return the runs reported now."""
        if self._stuck_after_ms is None:
            return []
        now = self._clock()
        stuck: list[HandlerRun] = []
        with self._cond:
            for run in self._running:
                started = run.started_at
                if not run.warned and started is not None and now - started > self._stuck_after_ms:
                    run.warned = True
                    stuck.append(run)
        for run in stuck:
            self._metrics.record_handler_stuck(run.workflow_type)
            _log.warning(
                "the handler for workflow %r (type %r) has been running for more than %d ms on "
                "thread %s; it still holds its claim (renewed while it runs): make it finish, "
                "or fail the workflow",
                run.workflow_id,
                run.workflow_type,
                self._stuck_after_ms,
                None if run.thread is None else run.thread.name,
            )
        return stuck

    def close(self, timeout: float | None) -> list[HandlerRun]:
        """Drop queued runs, wait up to ``timeout`` s for running ones; return those abandoned.

        Idempotent. Never called from a handler thread (it would wait for itself).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._pid != os.getpid():
                return []
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            threads = list(self._threads)
            self._cond.notify_all()
            self._settled.notify_all()
        for run in dropped:
            run.done.set()
        current = threading.current_thread()
        for thread in threads:
            if thread is current:
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)
        abandoned = self.running()
        for run in abandoned:
            _log.warning(
                "closing: the handler for workflow %r is still running on thread %s and is "
                "abandoned; its claim is released with the others (or, if that fails, left to "
                "expire), so its later writes are refused",
                run.workflow_id,
                None if run.thread is None else run.thread.name,
            )
        return abandoned

    def _work(self) -> None:
        # Counted idle from its start (by submit), and again after each run.
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if not self._queue:
                    return
                run = self._queue.popleft()
                run.started_at = self._clock()
                run.thread = threading.current_thread()
                self._running.append(run)
            try:
                run.body()
            except BaseException:
                _log.exception("weft_sync: a handler run for workflow %r raised", run.workflow_id)
            finally:
                with self._cond:
                    self._running.remove(run)
                    self._idle += 1
                    self._settled.notify_all()
                run.done.set()
