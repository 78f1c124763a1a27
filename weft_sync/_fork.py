"""Fork safety shared by every object a forked child must not use.

An object created in one process and inherited by a child through ``os.fork()`` still points at
the parent's claims, threads, connections and locks. None of that may be used by the child: it
would write under the parent's engine id with nothing renewing it, or talk on the parent's
database sessions. Each such object records the process that created it (``_fork_pid``) and
guards itself with :func:`process_bound_class`: its public methods raise
:class:`~weft_sync.errors.ClosedError` in any other process (a process id compare, cheap enough
for every call). The child opens fresh objects instead.

Inherited resources that cannot be released without disturbing the parent (a psycopg session's
socket, a SQLite connection a parent thread was using) are kept referenced with :func:`pin` so that
their finalisers never run in the child.

What a child must do with inherited state (close its copy of a lock file's descriptor, forget
the parent's claims, replace a lock a vanished thread may hold) runs from one
``os.register_at_fork(after_in_child=...)`` hook. Importing the library registers nothing: the
hook is registered when the first object that needs it opens (:func:`track`), and since Python
offers no way to unregister a fork hook, it stays registered after the last one closes, then
doing nothing but a check of an empty set. Nothing runs before a fork or in the parent after it:
a fork never waits for the library, and the library does not pause its threads for it.

What no library can make safe is a fork while another thread of the process is inside a C
library that keeps process-wide state (SQLite, libpq, OpenSSL): the child gets that library's
locks and bookkeeping as the vanished thread left them. As psycopg and SQLAlchemy advise for
their connections, a process that forks should open the library's objects after the fork (a
pre-forking server: in each worker), or fork only while none of them is in use, and a child
must never use an object it inherited: it opens its own.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from .errors import ClosedError

_log = logging.getLogger(__name__)

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


class ForkAware(Protocol):
    """An open object with something to let go of in a forked child (see :func:`track`)."""

    def _after_fork_in_child(self) -> None:
        """Make the inherited copy inert: touch nothing the parent still uses."""
        ...


# Every tracked object of this process; weak, so an abandoned one can still be collected.
_OPEN: weakref.WeakSet[ForkAware] = weakref.WeakSet()
# Module-level resets (a lock a vanished thread may hold), run before the objects' own.
_RESETS: list[Callable[[], object]] = []
# The first caller of next() gets 0 and registers the hook: one registration per process
# without a lock that a thread could hold across a fork.
_registrations = itertools.count()
_registered = False


def track(obj: ForkAware) -> None:
    """Run ``obj._after_fork_in_child()`` in every child forked while ``obj`` is tracked.

    The first call of the process registers the one fork hook (see the module docstring).
    """
    if not _registered:
        _register_hook()
    _OPEN.add(obj)


def untrack(obj: ForkAware) -> None:
    """Stop tracking ``obj`` (it was closed); a no-op when it is not tracked."""
    _OPEN.discard(obj)


def tracked() -> list[ForkAware]:
    """The objects a fork would reset now."""
    return list(_OPEN)


def hook_registered() -> bool:
    """Whether this process registered the library's fork hook (something was opened)."""
    return _registered


def reset_in_child(reset: Callable[[], object]) -> None:
    """Run ``reset`` in a forked child before the tracked objects', whenever one is tracked.

    For module-level state, e.g. a lock that a thread of the parent may hold at fork time.
    Registering it registers no fork hook; :func:`track` does, when something opens.
    """
    if reset not in _RESETS:
        _RESETS.append(reset)


def _register_hook() -> None:
    global _registered
    if next(_registrations) == 0 and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _registered = True


def _after_fork_in_child() -> None:
    objects = list(_OPEN)
    if not objects:
        return
    for reset in list(_RESETS):
        _run_in_child(reset, reset)
    for obj in objects:
        _run_in_child(obj._after_fork_in_child, obj)
    # Every inherited object is inert now; the child's own objects track themselves.
    _OPEN.clear()


def _run_in_child(step: Callable[[], object], what: object) -> None:
    # One failure must not leave the other objects live in the child.
    try:
        step()
    except Exception:
        _log.exception("could not reset %r in a forked child", what)
