"""Polling waits with a hang guard: a condition that never comes fails the test, naming it.

Each wait polls until its condition holds and raises :class:`AssertionError` once
``timeout_s`` has passed. The bound only turns a hang into a failure: reaching it means the
test failed, never that something was slow by a measured amount.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, TypeVar

_T = TypeVar("_T")

WAIT_S: Final = 10.0
"""The default bound of a wait, in seconds."""
POLL_S: Final = 0.005
"""The default pause between two probes, in seconds."""


def wait_until(
    condition: Callable[[], bool], what: str, *, timeout_s: float = WAIT_S, poll_s: float = POLL_S
) -> None:
    """Call ``condition`` every ``poll_s`` seconds until it holds.

    :param what: what is awaited, as the failure names it (``"the lock is not held"``).
    :raises AssertionError: ``condition`` still did not hold after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for: {what}")
        time.sleep(poll_s)


def wait_for(
    probe: Callable[[], _T],
    accept: Callable[[_T], bool],
    what: str,
    *,
    timeout_s: float = WAIT_S,
    poll_s: float = POLL_S,
) -> _T:
    """Call ``probe`` every ``poll_s`` seconds until ``accept`` takes its value; return it.

    :param what: what is awaited, as the failure names it (with the last value probed).
    :raises AssertionError: no value was accepted within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for: {what}; last value {value!r}"
            )
        time.sleep(poll_s)


def wait_set(event: threading.Event, what: str, *, timeout_s: float = WAIT_S) -> None:
    """Wait for ``event`` to be set.

    :raises AssertionError: it was not set within ``timeout_s`` seconds.
    """
    if not event.wait(timeout_s):
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for: {what}")
