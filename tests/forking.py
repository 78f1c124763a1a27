"""Forking a child in a test: bounded waits, and the stacks of a child that hangs.

A child runs its body and leaves with ``os._exit``: exit code 0, or 1 with the traceback written
to its report file. The parent waits for it a bounded time; a child still running then is asked
for its threads' stacks (an inherited faulthandler on SIGUSR1), killed, and the test fails with
those stacks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["CHILD_DEADLINE_S", "expected_fork_warning", "fork_child", "stacks_path", "wait_child"]

CHILD_DEADLINE_S = 10.0


@contextlib.contextmanager
def expected_fork_warning() -> Iterator[None]:
    """Expect the DeprecationWarning Python 3.12+ gives for a fork with other threads running.

    A test that forks with threads running (the library's own, or the test's) does so on
    purpose; the warning is asserted, not silenced. Before 3.12 there is none.
    """
    if sys.version_info >= (3, 12) and threading.active_count() > 1:
        with pytest.warns(DeprecationWarning, match="multi-threaded"):
            yield
    else:
        yield


def stacks_path(report: Path) -> Path:
    return report.with_suffix(".stacks")


def fork_child(body: Callable[[], None], report: Path, deadline_s: float = CHILD_DEADLINE_S) -> int:
    """Fork, run ``body`` in the child; return its pid (wait for it with the same deadline).

    The child inherits a SIGUSR1 handler that writes every thread's stack to its stacks file, so
    that a child hanging before its own code runs (inside the fork handlers) can still be asked
    for its stacks by :func:`wait_child`.
    """
    signal_stacks = open(stacks_path(report).with_suffix(".signal"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=signal_stacks, all_threads=True)
    pid = -1
    try:
        with expected_fork_warning():
            pid = os.fork()
    finally:
        if pid != 0:
            faulthandler.unregister(signal.SIGUSR1)
            signal_stacks.close()
    if pid == 0:  # pragma: no cover - runs in the child
        signal.alarm(max(1, int(deadline_s * 2)))
        # A child that hangs writes every thread's stack before the parent gives up on it.
        stacks = open(stacks_path(report), "w")  # noqa: SIM115 - open until os._exit
        faulthandler.dump_traceback_later(deadline_s * 0.8, file=stacks)
        code = 0
        try:
            body()
        except BaseException:
            report.write_text(traceback.format_exc())
            code = 1
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int, report: Path, deadline_s: float = CHILD_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)  # the inherited faulthandler writes its stacks
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            stacks = stacks_path(report)
            asked = stacks.with_suffix(".signal")
            dumped = (
                "\n".join(
                    f"{path.name}:\n{path.read_text()}"
                    for path in (stacks, asked)
                    if path.exists() and path.read_text()
                )
                or "(no stacks were written)"
            )
            raise AssertionError(
                f"the forked child did not finish within {deadline_s} s; its threads:\n{dumped}"
            )
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status)
    details = report.read_text() if report.exists() else ""
    assert code == 0, f"child failed with exit code {code}:\n{details}"
