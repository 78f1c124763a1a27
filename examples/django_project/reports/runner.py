"""The report threads of one process, and how they stop when the process exits.

Report jobs run on a few daemon threads fed by a queue. At exit (a gunicorn worker told to stop,
``runserver`` interrupted) :func:`stop` is called before weft_sync's own exit hook closes the
``Ownership``: each job stops between two pages, so the close releases its claim and another
process resumes it at once, rather than the process waiting for every job to finish (and being
killed at gunicorn's graceful timeout with its claims still held).

Threading: one lock (``_lock``) guards the thread list, the queue and the owning pid.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["STOPPING", "stop", "submit"]

STOPPING = threading.Event()
"""Set when the process is exiting: a job checks it before each page."""
STOP_WAIT_S = 5.0

# _lock guards _threads, _queue and _pid.
_lock = threading.Lock()
_threads: list[threading.Thread] = []
_queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
_pid: int | None = None


def submit(job_id: str, drive: Callable[[str], None], threads: int) -> None:
    """Run ``drive(job_id)`` on one of this process's ``threads`` report threads."""
    global _queue, _pid
    with _lock:
        if _pid != os.getpid():
            # Forked: the parent's threads do not exist here.
            _threads.clear()
            _queue, _pid = queue.SimpleQueue(), os.getpid()
        jobs = _queue
        while len(_threads) < threads:
            thread = threading.Thread(
                target=_work, args=(jobs, drive), name=f"report-{len(_threads)}", daemon=True
            )
            _threads.append(thread)
            thread.start()
    jobs.put(job_id)


def stop(timeout: float = STOP_WAIT_S) -> None:
    """Ask every job to stop between pages and wait (up to ``timeout``) for the threads."""
    STOPPING.set()
    with _lock:
        threads = list(_threads) if _pid == os.getpid() else []
        jobs = _queue
    for _ in threads:
        jobs.put(None)
    for thread in threads:
        thread.join(timeout / max(1, len(threads)))


def _work(jobs: queue.SimpleQueue[str | None], drive: Callable[[str], None]) -> None:
    while (job_id := jobs.get()) is not None and not STOPPING.is_set():
        drive(job_id)


# Registered after weft_sync.django's hook (imported above this module), so it runs before it.
atexit.register(stop)
