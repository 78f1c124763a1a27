"""Fork safety shared by every object a forked child must not use.

An object created in one process and inherited by a child through ``os.fork()`` still points at
the parent's claims, threads, connections and locks. None of that may be used by the child: it
would write under the parent's engine id with nothing renewing it, or talk on the parent's
database sessions. Each such object records the process that created it (``_fork_pid``) and
guards itself with :func:`process_bound_class`: its public methods raise
:class:`~weft_sync.errors.ClosedError` in any other process (a process id compare, cheap enough
for every call). The child opens fresh objects instead.

Inherited resources that cannot be released without disturbing the parent (a psycopg session's
socket, a SQLite handle a parent thread was using) are kept referenced with :func:`pin` so that
their finalisers never run in the child.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from .errors import ClosedError

__all__ = [
    "ProcessBound",
    "inherited_error",
    "pause_in_turns",
    "pin",
    "process_bound",
    "process_bound_class",
    "register_at_fork",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

# Inherited resources a child must neither use nor finalise; appended to only in children.
_PINNED: list[object] = []


class ProcessBound(Protocol):
    """An object that records the id of the process that created it."""

    _fork_pid: int


_Bound = TypeVar("_Bound", bound=ProcessBound)


def inherited_error(obj: object, created_in: int, what: str | None = None) -> ClosedError:
    """The error for using ``obj`` (in ``what``, e.g. ``"get()"``) outside its creating process."""
    kind = type(obj).__name__
    use = f"{kind}.{what}" if what else f"a method of {kind}"
    return ClosedError(
        f"{use} was called in process {os.getpid()} on a {kind} created in process "
        f"{created_in} and inherited across os.fork(); a forked child cannot use its parent's "
        f"objects (they stand for the parent's claims, threads and connections): open a new "
        f"Ownership (or {kind}) in the child process"
    )


def process_bound(
    method: Callable[Concatenate[_Bound, _P], _R],
) -> Callable[Concatenate[_Bound, _P], _R]:
    """Make ``method`` raise :func:`inherited_error` when called outside the creating process."""
    name = f"{method.__name__}()"

    @functools.wraps(method)
    def guarded(self: _Bound, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._fork_pid != os.getpid():
            raise inherited_error(self, self._fork_pid, name)
        return method(self, *args, **kwargs)

    return guarded


def process_bound_class(cls: type[_T]) -> type[_T]:
    """Apply :func:`process_bound` to every public method of ``cls``.

    ``close`` stays callable (it must be safe in a child: it lets go of inherited state), and so
    do private and special methods and properties (identity such as an engine id or a path stays
    readable, for messages).
    """
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and name != "close" and inspect.isfunction(value):
            setattr(cls, name, process_bound(value))
    return cls


def pin(*resources: object) -> None:
    """Keep inherited ``resources`` referenced for the child's lifetime, so none is finalised."""
    _PINNED.extend(resources)


def pause_in_turns(
    items: Sequence[_T],
    deadline: Callable[[_T], float],
    pause: Callable[[_T, float], bool],
    poll_s: float,
) -> tuple[list[_T], list[_T]]:
    """Before a fork: pause each of ``items`` by its own ``deadline`` (a monotonic time).

    ``pause(item, until)`` tries until ``until`` and returns whether the item is paused (on
    ``False`` it holds nothing). Attempts take turns, each waiting at most ``poll_s`` seconds, so
    an item that stays busy for long (or for ever, when the thread holding its lock is stuck)
    neither uses up the wait of the items after it nor keeps them from being paused as soon as
    they can be: the fork takes no longer than the latest deadline.

    :returns: the items paused and the items given up on, each in the order of ``items``.
    """
    waiting = [(item, deadline(item)) for item in items]
    paused: list[_T] = []
    given_up: list[_T] = []
    while waiting:
        still: list[tuple[_T, float]] = []
        for item, until in waiting:
            if pause(item, min(until, time.monotonic() + poll_s)):
                paused.append(item)
            elif time.monotonic() < until:
                still.append((item, until))
            else:
                given_up.append(item)
        waiting = still
    return paused, given_up


def register_at_fork(
    *,
    before: Callable[[], object] | None = None,
    after_in_parent: Callable[[], object] | None = None,
    after_in_child: Callable[[], object] | None = None,
) -> None:
    """Register fork handlers where the platform has them (a no-op elsewhere)."""
    if not hasattr(os, "register_at_fork"):  # pragma: no cover - Windows
        return
    handlers: dict[str, Callable[[], object]] = {}
    if before is not None:
        handlers["before"] = before
    if after_in_parent is not None:
        handlers["after_in_parent"] = after_in_parent
    if after_in_child is not None:
        handlers["after_in_child"] = after_in_child
    os.register_at_fork(**handlers)
