"""SQLite's process-wide mutexes around ``os.fork()``: a child never inherits one held.

SQLite guards a few process-wide structures with static mutexes. A thread that is inside one of
them when another thread forks leaves the child a copy of the mutex that is locked for ever: no
thread of the child will unlock it, and the child hangs on its first SQLite call that needs it
(closing an inherited connection, opening its own). Pausing the storages of this library does not
prevent that: any thread may be inside SQLite on a connection of its own, or finalising an
unreachable ``sqlite3.Connection`` in a garbage collection.

So a fork takes them, through :mod:`ctypes` and the SQLite library the ``sqlite3`` module is
linked with, once the storages are paused, and lets go of them after the fork in the parent and
in the child. They are tried, never waited for: when one is busy every mutex taken is let go and
the fork sleeps briefly (other threads run meanwhile) and tries again, up to a deadline. No order
among them, or against SQLite's own nesting, can then deadlock.

Which ones (SQLite 3.40: ``mutex.h``, ``os_unix.c``, ``malloc.c``, ``pcache1.c``, ``random.c``,
``notify.c``):

- held across the fork, as they guard state their holders modify: ``VFS1`` (the unix VFS's
  list of open files, changed on every open and close and shared-memory map), ``PRNG``
  (``sqlite3_randomness``: WAL salts, temporary names), ``PMEM`` and ``LRU`` (the page cache's
  allocations and statistics), ``OPEN`` (shared-cache opens), ``VFS2`` and ``VFS3`` (other
  VFSes). The ``APP`` mutexes belong to applications and are left to them.
- let go of in the child when a thread it does not have held them: ``MEM`` and ``MAIN``. With
  memory statistics on (the default) SQLite takes ``MEM`` on every allocation, also in calls
  that the ``sqlite3`` module makes without releasing the GIL (binding a text or blob parameter
  copies it): a thread waiting for it there would keep the GIL the forking thread needs to
  finish the fork. It guards only the memory counters around the C library's ``malloc``, which
  the C library keeps consistent across ``fork()``. ``MAIN`` is taken whenever a statement ends
  (with unlock notification compiled in, as in common builds) and by every open, to read lists
  (VFSes, automatic extensions, blocked connections) that change only when an application
  registers a VFS or an extension, or with shared cache. Holding it would hang the child on
  itself: before any fork handler runs, Python frees what the other threads' thread-locals held,
  and a ``sqlite3.Cursor`` in the middle of a read, reset then, ends its statement.

Between taking them and letting go, the forking thread must not enter SQLite itself (they are not
recursive): garbage collection, which may close a ``sqlite3.Connection``, is paused meanwhile.
A fork handler registered before this library was imported runs inside that window; one that
uses SQLite would wait for the mutexes.

Where the library cannot be reached (SQLite linked statically without exporting its functions,
another version than the ``sqlite3`` module's, another copy), :func:`ensure_supported` warns
once and forks go on without this guard.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .sqlite_library import Lazy, open_library

if TYPE_CHECKING:
    import ctypes

__all__ = [
    "FREED_IN_CHILD",
    "HELD_ACROSS_FORK",
    "SqliteLibrary",
    "after_fork_in_child",
    "after_fork_in_parent",
    "before_fork",
    "describe",
    "ensure_supported",
    "library",
    "load",
]

# SQLITE_MUTEX_STATIC_* ids (sqlite3.h).
_MAIN: Final = 2
_MEM: Final = 3
_OPEN: Final = 4
_PRNG: Final = 5
_LRU: Final = 6
_PMEM: Final = 7
_VFS1: Final = 11
_VFS2: Final = 12
_VFS3: Final = 13
FREED_IN_CHILD: Final = {"MEM": _MEM, "MAIN": _MAIN}
HELD_ACROSS_FORK: Final = {
    "OPEN": _OPEN,
    "PRNG": _PRNG,
    "LRU": _LRU,
    "PMEM": _PMEM,
    "VFS1": _VFS1,
    "VFS2": _VFS2,
    "VFS3": _VFS3,
}
_SQLITE_OK: Final = 0
_BACKOFF_MIN_S: Final = 0.0001
_BACKOFF_MAX_S: Final = 0.002


@dataclass(frozen=True, slots=True)
class SqliteLibrary:
    """The SQLite library of the ``sqlite3`` module: its mutex functions and static mutexes.

    ``held`` are the addresses of the mutexes a fork holds (a build without mutexes has none),
    ``freed_in_child`` those the child lets go of if they were held at fork time.
    """

    version: str
    held: tuple[int, ...]
    freed_in_child: tuple[int, ...]
    try_enter: Callable[[int], int]
    enter: Callable[[int], None]
    leave: Callable[[int], None]

    def try_all(self) -> bool:
        """Take every mutex of ``held``, or none: ``False`` when one was busy."""
        taken: list[int] = []
        for mutex in self.held:
            if self.try_enter(mutex) != _SQLITE_OK:
                for done in reversed(taken):
                    self.leave(done)
                return False
            taken.append(mutex)
        return True

    def leave_all(self) -> None:
        for mutex in reversed(self.held):
            self.leave(mutex)


def _bind(dll: ctypes.PyDLL) -> SqliteLibrary | str:
    """Bind the mutex functions of ``dll``; a reason (text) when one is not exported."""
    import ctypes

    try:
        threadsafe = dll.sqlite3_threadsafe
        alloc = dll.sqlite3_mutex_alloc
        try_enter = dll.sqlite3_mutex_try
        enter = dll.sqlite3_mutex_enter
        leave = dll.sqlite3_mutex_leave
    except AttributeError as exc:
        return f"a SQLite function is not exported ({exc})"
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_int]
    try_enter.restype, try_enter.argtypes = ctypes.c_int, [ctypes.c_void_p]
    enter.restype, enter.argtypes = None, [ctypes.c_void_p]
    leave.restype, leave.argtypes = None, [ctypes.c_void_p]

    def static(ids: dict[str, int]) -> tuple[int, ...]:
        if threadsafe() == 0:
            return ()
        return tuple(m for m in (alloc(i) for i in ids.values()) if m)

    return SqliteLibrary(
        sqlite3.sqlite_version,
        static(HELD_ACROSS_FORK),
        static(FREED_IN_CHILD),
        try_enter,
        enter,
        leave,
    )


def load(path: str | None = None, *, expected_version: str | None = None) -> SqliteLibrary | str:
    """Find the SQLite library of ``path`` (default: the one of the ``_sqlite3`` module) and
    bind its mutexes (see :func:`~weft_sync.storage.sqlite_library.open_library`).

    :returns: the library, or the reason it cannot be used (text).
    """
    dll = open_library(path, expected_version=expected_version)
    return dll if isinstance(dll, str) else _bind(dll)


_library: Lazy[SqliteLibrary | str] = Lazy(load)
# Guards _warned (warning once).
_warn_lock = threading.Lock()
_warned = False


def library() -> SqliteLibrary | str:
    """The library of the ``sqlite3`` module, bound on first use; or why it cannot be used."""
    return _library.get()


def ensure_supported() -> None:
    """Warn once (``RuntimeWarning``) when forks cannot take SQLite's mutexes.

    Silent where the platform does not fork.
    """
    global _warned
    if not hasattr(os, "register_at_fork"):  # pragma: no cover - Windows
        return
    found = library()
    if not isinstance(found, str):
        return
    with _warn_lock:
        first, _warned = not _warned, True
    if first:
        warnings.warn(
            f"weft_sync cannot take SQLite's process-wide mutexes around os.fork(): {found}; a "
            f"child forked while another thread is inside SQLite may hang in SQLite (fork before "
            f"starting threads that use SQLite, or use the 'spawn' start method)",
            RuntimeWarning,
            stacklevel=4,  # the code opening the storage
        )


def describe() -> str:
    """One line on what forks do with SQLite's mutexes here."""
    found = library()
    if isinstance(found, str):
        return f"not available: {found}"
    return (
        f"SQLite {found.version}: {len(found.held)} static mutexes held across fork, "
        f"{len(found.freed_in_child)} let go of in the child if held"
    )


# -- the fork handlers' part ---------------------------------------------------------------

# Guards _gc_pauses and _gc_restore: forks on several threads at once share the pause.
_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_restore = False
# Per forking thread: whether this fork holds the mutexes.
_held = threading.local()


def _pause_gc() -> None:
    global _gc_pauses, _gc_restore
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_restore = gc.isenabled()
            gc.disable()
        _gc_pauses += 1


def _resume_gc() -> None:
    global _gc_pauses
    with _gc_lock:
        _gc_pauses -= 1
        if _gc_pauses == 0 and _gc_restore:
            gc.enable()


def before_fork(deadline: float) -> bool:
    """Take every mutex of :data:`HELD_ACROSS_FORK`, trying until ``deadline`` (monotonic).

    :returns: ``False`` if one stayed busy until ``deadline``: none is then held, and the fork
        goes on without them, as it does where the library cannot be reached.
    """
    lib = library()
    _held.lib = None
    if isinstance(lib, str) or not lib.held:
        return True
    _pause_gc()
    delay = _BACKOFF_MIN_S
    while not lib.try_all():
        if time.monotonic() >= deadline:
            _resume_gc()
            return False
        time.sleep(delay)  # holding nothing, and without the GIL
        delay = min(delay * 2, _BACKOFF_MAX_S)
    _held.lib = lib
    return True


def after_fork_in_parent() -> None:
    """Let go of what :func:`before_fork` took on this thread."""
    lib: SqliteLibrary | None = getattr(_held, "lib", None)
    _held.lib = None
    if lib is not None:
        lib.leave_all()
        _resume_gc()


def after_fork_in_child() -> None:
    """Let go of what the fork took, and of :data:`FREED_IN_CHILD` if another thread held them."""
    global _gc_pauses, _gc_lock, _warn_lock
    _gc_lock, _warn_lock = threading.Lock(), threading.Lock()  # a parent thread may hold them
    _library.after_fork_in_child()
    lib: SqliteLibrary | None = getattr(_held, "lib", None)
    _held.lib = None
    if lib is not None:
        lib.leave_all()
    found = _library.value
    if isinstance(found, SqliteLibrary):
        for mutex in found.freed_in_child:
            # The child has one thread: a busy one was held by a thread it does not have.
            found.try_enter(mutex)
            found.leave(mutex)
    if _gc_pauses:
        _gc_pauses = 0
        if _gc_restore:
            gc.enable()
