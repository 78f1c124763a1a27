"""What a forked child does with the SQLite connections of the storages it inherited.

A fork is never delayed: nothing runs before it or in the parent after it. In the child, the
process-wide hook of :mod:`weft_sync._fork` (registered when the first storage opens) looks at
what each inherited storage was doing at the instant of the fork, from the locks its own code
holds around every use of a connection (the writer's transaction lock, each reader's gate, and
:func:`opening` for the connections a storage opens outside both):

- none held: no thread of the library was inside SQLite on any of them, so the child closes its
  copies. SQLite keeps per-process lock bookkeeping for each file, and closing the copies lets
  the child's own connections to the same file start from clean bookkeeping (left open, they
  would make those connections skip the operating-system locks that keep other processes from
  checkpointing and deleting the write-ahead log under them). SQLite's "How To Corrupt An
  SQLite Database File" advises against closing an inherited connection at all, because a
  close may clean up files under the parent; a copy that holds no transaction has nothing to
  roll back, and its close cannot checkpoint or delete the log while the parent has the file
  open (that needs an exclusive lock the parent's shared one refuses);
- one held: a thread was inside SQLite at the fork and the child cannot know in what state it
  left SQLite, so it touches none of the inherited connections (they are pinned, never
  finalised) and logs a warning: the child's own connections to those files share the
  bookkeeping the parent's thread left behind and may fail with "database is locked".

Either way the inherited storages raise :class:`~weft_sync.errors.ClosedError` in the child,
which opens its own. What the library cannot see is a thread of the host's own inside SQLite at
fork time (its own connections, a ``dict_view``); fork while none is, or open the storage in
the child.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from ... import _fork

_log = logging.getLogger("weft_sync.storage.sqlite.store")


class Abandonable(Protocol):
    """What a storage offers the child (implemented by ``SqliteStorage``)."""

    def _in_sqlite(self) -> bool: ...

    def _abandon_in_child(self, *, close: bool) -> None: ...

    def _after_fork_in_child(self) -> None: ...


# Held while a storage creates its table or checks its identity on a fresh connection (outside
# its writer and readers), so that a child can tell. Replaced in the child.
_opening = threading.Lock()
# Every open storage of this process; weak, so an abandoned one can still be collected.
_LIVE: weakref.WeakSet[Abandonable] = weakref.WeakSet()
# In a child: whether the inherited connections may be closed (see closing_is_safe).
_close_in_child = False


def track(storage: Abandonable) -> None:
    """Let go of ``storage``'s inherited connections in every child forked from now on."""
    _LIVE.add(storage)
    _fork.track(storage)


def untrack(storage: Abandonable) -> None:
    """Forget ``storage`` (it was closed or abandoned)."""
    _LIVE.discard(storage)
    _fork.untrack(storage)


def live() -> list[Abandonable]:
    """The storages a fork would find open now."""
    return list(_LIVE)


@contextmanager
def opening() -> Iterator[None]:
    """Mark a storage's use of a connection outside its writer and readers (see the module)."""
    with _opening:
        yield


def closing_is_safe() -> bool:
    """In a forked child: whether no storage of the library was inside SQLite at the fork."""
    return _close_in_child


def _survey_in_child() -> None:
    # Runs before any storage lets go (see _fork.reset_in_child), on the copies' lock states.
    global _opening, _close_in_child
    busy = _opening.locked() or any(storage._in_sqlite() for storage in list(_LIVE))
    _close_in_child = not busy
    _opening = threading.Lock()
    if busy:
        _log.warning(
            "process %d was forked while a thread was inside SQLite on a connection of "
            "weft_sync: it keeps the SQLite connections it inherited unused and open, and its "
            "own connections to the same files may fail with 'database is locked'; fork while "
            "no storage is in use, or open storages after the fork",
            os.getpid(),
        )


_fork.reset_in_child(_survey_in_child)
