"""No work in a pre-fork master: an engine whose process forks stops its background work there.

A pre-forking server (gunicorn ``--preload``, uWSGI without ``lazy-apps``) imports the app in a
master process and forks its workers from it. An ``Ownership`` opened at import time there
would keep renewing, reclaiming and running handlers in the master, which serves no request and
is not where the host expects its work to run. So the first time a process forks after it
opened an ``Ownership`` with ``background="thread"``, every such engine of the process stops
its background maintenance, its crash probe and its handler executor, with one warning that says
why and what to do: open the ``Ownership`` lazily in each worker (``weft_sync.flask`` and
``weft_sync.django`` already do). The claims it holds are no longer renewed: they expire and
the workers' reclaim passes take them over. The children get nothing (see
:mod:`weft_sync.ownership.facade`: an inherited engine is inert).

Forks that are not a server's: a fork made by one of the engine's own handler threads (a handler
that forks a helper process) stops nothing, and ``OwnershipOptions(on_fork="continue")`` keeps an
engine running through every fork (a host that forks helper processes with ``os.fork()`` or
``multiprocessing``'s fork start method, knowing that the children must not use it).

The hook is registered with :func:`os.register_at_fork` (``before=``) once per process, when the
first such engine opens, never at import; with no engine watched it does nothing. This module has
one lock, guarding the registration flag; the set of watched engines is a ``WeakSet`` read and
written under it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Protocol

_log = logging.getLogger(__name__)


class ForkStoppable(Protocol):
    """An engine that can stop its background work in a process about to fork."""

    def _stop_before_fork(self) -> bool:
        """Stop background work unless the fork is exempt; return whether anything stopped."""
        ...


# _lock guards _registered and _watched.
_lock = threading.Lock()
_registered = False
_watched: weakref.WeakSet[ForkStoppable] = weakref.WeakSet()


def watch(engine: ForkStoppable) -> None:
    """Stop ``engine``'s background work if this process forks (registers the hook once)."""
    global _registered
    with _lock:
        _watched.add(engine)
        register = not _registered and hasattr(os, "register_at_fork")
        _registered = _registered or register
    if register:
        os.register_at_fork(before=_before_fork)


def unwatch(engine: ForkStoppable) -> None:
    """Forget ``engine`` (it closed)."""
    with _lock:
        _watched.discard(engine)


def _before_fork() -> None:
    with _lock:
        engines = list(_watched)
    stopped = 0
    for engine in engines:
        try:
            if engine._stop_before_fork():
                stopped += 1
                unwatch(engine)
        except Exception:
            _log.exception("could not stop %r before a fork", engine)
    if stopped:
        _log.warning(
            "process %d is forking with %d open weft_sync Ownership(s) running background "
            "maintenance: their maintenance, crash probe and handlers are stopped in this "
            "process, so a pre-fork master (gunicorn --preload) drives no workflow. Open the "
            "Ownership lazily in each worker process instead (weft_sync.flask and "
            "weft_sync.django do); the claims held here expire and are taken over by the "
            "workers. A host that forks helper processes itself can pass "
            "OwnershipOptions(on_fork='continue').",
            os.getpid(),
            stopped,
        )
