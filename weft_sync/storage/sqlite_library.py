"""The SQLite library the ``sqlite3`` module is linked with, reached through :mod:`ctypes`.

Two things need SQLite's C functions that the ``sqlite3`` module does not expose: taking its
process-wide mutexes around ``os.fork()`` (:mod:`~weft_sync.storage.sqlite_mutexes`) and asking a
connection which file it has open without running a statement
(:mod:`~weft_sync.storage.sqlite_handle`). Both must call the very copy of SQLite the module
uses — another copy keeps other mutexes and other connections — so :func:`open_library` loads
it through the ``_sqlite3`` extension's own file and checks its version and that it is the same
instance before handing it out.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import ctypes

__all__ = ["Lazy", "open_library"]

_T = TypeVar("_T")


class Lazy(Generic[_T]):
    """A value made by ``make()`` on first use and kept for the process.

    It is made outside the lock (making one may open a connection, which must not happen under
    a lock); two first callers that race both make one, and the first kept is the one both get.

    :param make: makes the value (never ``None``); called with no lock held.
    """

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        # Guards the setting of value (once).
        self._lock = threading.Lock()
        self.value: _T | None = None

    def get(self) -> _T:
        """The value, made now if it was not yet."""
        found = self.value
        if found is None:
            made = self._make()
            with self._lock:
                if self.value is None:
                    self.value = made
                found = self.value
        return found

    def after_fork_in_child(self) -> None:
        """Replace the lock, which a thread the child does not have may have held."""
        self._lock = threading.Lock()


def open_library(
    path: str | None = None, *, expected_version: str | None = None
) -> ctypes.PyDLL | str:
    """Load the SQLite library of ``path`` (default: the one of the ``_sqlite3`` module).

    Calls through the returned library keep the GIL (:class:`ctypes.PyDLL`): every function
    used through it returns at once.

    :param expected_version: the version it must report (default ``sqlite3.sqlite_version``).
    :returns: the library, or the reason it cannot be used (text).
    """
    if path is None:
        import _sqlite3

        # dlsym on the module's handle searches the libraries it is linked with; a module built
        # into the interpreter has no file, and the interpreter's own symbols are searched.
        path = getattr(_sqlite3, "__file__", None)
    try:
        import ctypes  # not in every build of Python; imported only here, where it is needed

        dll = ctypes.PyDLL(path)
    except ImportError as exc:
        return f"ctypes is not available ({exc})"
    except OSError as exc:
        return f"the SQLite library could not be loaded ({exc})"
    try:
        libversion = dll.sqlite3_libversion
        memory_used = dll.sqlite3_memory_used
    except AttributeError as exc:
        return f"a SQLite function is not exported ({exc})"
    libversion.restype = ctypes.c_char_p
    memory_used.restype = ctypes.c_int64
    expected = sqlite3.sqlite_version if expected_version is None else expected_version
    version = (libversion() or b"").decode("ascii", "replace")
    if version != expected:
        return f"the library found is SQLite {version}, the sqlite3 module uses {expected}"
    if not _same_instance(memory_used):
        return "the library found is another copy than the one the sqlite3 module uses"
    return dll


def _same_instance(memory_used: Callable[[], Any]) -> bool:
    """Whether opening a connection through ``sqlite3`` moves this library's memory counter.

    Without memory statistics the counter stays at zero and nothing can be told: ``True``.
    """
    before = int(memory_used())
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE t (x)")
        during = int(memory_used())
    finally:
        conn.close()
    return during != before or during == 0
