"""Pausing every open ``SqliteStorage`` of the process around ``os.fork()``.

SQLite keeps per-process lock bookkeeping for each file, and a child inherits a copy: a
connection copied mid-transaction would make every write of the child's own connections fail as
"database is locked". Pausing every read and write until the fork is done lets the child close
its copies safely, so its own connections start from clean bookkeeping.

The storages are tried in turns, each against its own deadline (see
:func:`~weft_sync._fork.pause_in_turns`), so one stuck storage cannot use up the others' waits.
Table creation runs under :func:`opening`, which a fork waits for too. Once the storages are
paused, the fork takes SQLite's own process-wide mutexes (see
:mod:`~weft_sync.storage.sqlite_mutexes`), so that no thread of the process, the library's or
not, is inside them when the child is made.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, Protocol

from .._fork import pause_in_turns, register_at_fork
from . import sqlite_mutexes

__all__ = ["FORK_GRACE_S", "FORK_STUCK_GRACE_S", "Pausable", "live", "opening", "track", "untrack"]

FORK_GRACE_S: Final = 5.0
"""How much longer than its busy timeout a fork waits for a storage's reads and writes."""
FORK_STUCK_GRACE_S: Final = 0.1
"""The wait for a closed storage, or one the previous fork could not pause."""
_POLL_S: Final = 0.02
"""The longest a fork tries one storage before trying the others."""

_log = logging.getLogger("weft_sync.storage.sqlite")


class Pausable(Protocol):
    """What a storage offers the fork handlers (implemented by ``SqliteStorage``)."""

    _fork_stuck: bool

    def _fork_deadline(self, start: float) -> float: ...

    def _pause_for_fork(self, deadline: float) -> bool: ...

    def _resume_after_fork(self) -> None: ...

    def _abandon_in_child(self, *, paused: bool) -> None: ...


# Held while a storage creates its table or checks its identity on a fresh connection (outside
# any writer), so a fork waits for that too. Replaced in the child: a parent thread may have held
# it at fork time.
_opening = threading.Lock()
# Every open storage of this process; weak, so an abandoned one can still be collected.
_LIVE: weakref.WeakSet[Pausable] = weakref.WeakSet()
# Per forking thread (the fork handlers of one fork run on one thread, which the child keeps):
# ``paused``, the storages this fork paused, ``opening``, whether it holds _opening, and
# ``mutexes``, whether it holds SQLite's mutexes.
_fork_state = threading.local()


def track(storage: Pausable) -> None:
    """Pause ``storage`` at every fork from now on (warns once if SQLite's mutexes cannot be)."""
    sqlite_mutexes.ensure_supported()
    _LIVE.add(storage)


def untrack(storage: Pausable) -> None:
    """Stop pausing ``storage`` at forks (it was closed or abandoned)."""
    _LIVE.discard(storage)


def live() -> list[Pausable]:
    """The storages a fork would pause now."""
    return list(_LIVE)


@contextmanager
def opening() -> Iterator[None]:
    """Hold the lock a fork waits for while a storage opens a connection outside its writer."""
    with _opening:
        yield


def _before_fork() -> None:
    start = time.monotonic()
    _fork_state.opening = _opening.acquire(timeout=FORK_GRACE_S)
    storages = list(_LIVE)
    _fork_state.paused, stuck = pause_in_turns(
        storages, lambda s: s._fork_deadline(start), _pause, _POLL_S
    )
    for storage in stuck:
        storage._fork_stuck = True
    # Last, so that the paused storages' threads are not inside SQLite waiting for one of them.
    limit = max([start + FORK_GRACE_S, *(s._fork_deadline(start) for s in storages)])
    _fork_state.mutexes = sqlite_mutexes.before_fork(limit)


def _pause(storage: Pausable, deadline: float) -> bool:
    return storage._pause_for_fork(deadline)


def _forked() -> tuple[list[Pausable], bool, bool]:
    paused: list[Pausable] = getattr(_fork_state, "paused", [])
    held: bool = getattr(_fork_state, "opening", False)
    mutexes: bool = getattr(_fork_state, "mutexes", True)
    _fork_state.paused, _fork_state.opening, _fork_state.mutexes = [], False, True
    return paused, held, mutexes


def _after_fork_in_parent() -> None:
    sqlite_mutexes.after_fork_in_parent()
    paused, held, mutexes = _forked()
    for storage in paused:
        storage._resume_after_fork()
    if held:
        _opening.release()
    if not mutexes:
        _log.warning(
            "process %d forked a child while another thread stayed inside one of SQLite's "
            "process-wide mutexes past the fork's wait; the child may hang in SQLite",
            os.getpid(),
        )


def _after_fork_in_child() -> None:
    global _opening
    # First: closing the inherited connections below needs SQLite's mutexes.
    sqlite_mutexes.after_fork_in_child()
    _opening = threading.Lock()
    paused, _, _ = _forked()
    for storage in list(_LIVE):
        storage._abandon_in_child(paused=any(storage is p for p in paused))


register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
