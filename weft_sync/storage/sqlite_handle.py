"""Which file a ``sqlite3.Connection`` has open under a schema, asked of SQLite without a statement.

The host-data fence re-proves on every block that the host's ``sqlite3.Connection`` still has the
store's file open under the schema it proved (``ATTACH``/``DETACH`` and ``deserialize()`` change
that between two blocks, and a new connection can reuse a closed one's ``id()``). Running
``PRAGMA database_list`` for it costs a statement per block; ``sqlite3_db_filename()`` answers
the same question in well under a microsecond, from the same place in SQLite the pragma reads.

The ``sqlite3`` module does not expose its ``sqlite3 *`` handle, so :func:`filename_reader` reads
it from the connection object itself: in CPython the handle is the first field after the object
header (``pysqlite_Connection.db``, the same in every version since the module was added, and set
to ``NULL`` by ``close()``). That is trusted only where it was checked: on CPython 3.10 to 3.14,
with the SQLite library the module is linked with
(:func:`~weft_sync.storage.sqlite_library.open_library`), and after a self-test on a connection
of its own — the handle read must be the connection SQLite reports (the same default VFS, change
count, transaction state and files) and must become ``NULL`` when it closes. Anywhere else
:func:`filename_reader` returns ``None`` and the fence runs the pragma, as it always can.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .sqlite_library import Lazy, open_library

__all__ = ["FilenameReader", "file_check", "filename_reader", "unavailable_reason"]

FilenameReader = Callable[[sqlite3.Connection, bytes], "bytes | None"]
"""``reader(connection, schema)``: the file ``connection`` has open under ``schema`` (``b""`` for
an in-memory or temporary database), ``None`` for a schema it does not have or a closed
connection. The connection must be a ``sqlite3.Connection`` (or a subclass)."""

_CHECKED_VERSIONS = frozenset({(3, 10), (3, 11), (3, 12), (3, 13), (3, 14)})


@dataclass(frozen=True, slots=True)
class _Bound:
    reader: FilenameReader
    db_filename: Callable[[int, bytes], bytes | None]
    handle_at: Callable[[int], Any]  # ctypes.c_void_p.from_address
    offset: int


def file_check(
    schema: str, expected: str, otherwise: Callable[[str | None], bool]
) -> Callable[[sqlite3.Connection], bool] | None:
    """A check, for one ``sqlite3.Connection`` at a time, that it has ``expected`` open under
    ``schema``: ``True`` when SQLite reports exactly ``expected``, else ``otherwise(file)``
    (``file`` as SQLite reports it, ``None`` for a schema the connection does not have or a
    closed connection). ``None`` where :func:`filename_reader` is not available.

    It runs on every fenced block, so it is one function with no call of ours inside.
    """
    found = _load()
    if isinstance(found, str):
        return None
    schema_bytes, expected_bytes = os.fsencode(schema), os.fsencode(expected)
    db_filename, handle_at, offset = found.db_filename, found.handle_at, found.offset
    connection_type = sqlite3.Connection

    def check(connection: sqlite3.Connection) -> bool:
        if type(connection) is not connection_type and not isinstance(connection, connection_type):
            # The handle is read from the object's memory: only ever from a real one.
            raise TypeError(f"not a sqlite3.Connection: {type(connection).__name__}")
        handle = handle_at(id(connection) + offset)  # a c_void_p: passed on as it is
        file = db_filename(handle, schema_bytes) if handle else None
        if file == expected_bytes:
            return True
        return otherwise(None if file is None else os.fsdecode(file))

    return check


def filename_reader() -> FilenameReader | None:
    """The reader, bound and self-tested on first use; ``None`` where it cannot be trusted."""
    found = _load()
    return None if isinstance(found, str) else found.reader


def unavailable_reason() -> str | None:
    """Why :func:`filename_reader` returns ``None`` here, or ``None`` when it does not."""
    found = _load()
    return found if isinstance(found, str) else None


def _load() -> _Bound | str:
    return _found.get()


def _bind() -> _Bound | str:
    if sys.implementation.name != "cpython" or sys.version_info[:2] not in _CHECKED_VERSIONS:
        return (
            f"the layout of sqlite3.Connection is not checked for {sys.implementation.name} "
            f"{sys.version_info[0]}.{sys.version_info[1]}"
        )
    dll = open_library()
    if isinstance(dll, str):
        return dll
    import ctypes

    try:
        db_filename = dll.sqlite3_db_filename
        vfs_find = dll.sqlite3_vfs_find
        total_changes = dll.sqlite3_total_changes
        get_autocommit = dll.sqlite3_get_autocommit
    except AttributeError as exc:
        return f"a SQLite function is not exported ({exc})"
    db_filename.restype, db_filename.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_char_p]
    vfs_find.restype, vfs_find.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    total_changes.restype, total_changes.argtypes = ctypes.c_int, [ctypes.c_void_p]
    get_autocommit.restype, get_autocommit.argtypes = ctypes.c_int, [ctypes.c_void_p]
    offset = object.__basicsize__  # the object header: the handle is the next field
    pointer_at = ctypes.c_void_p.from_address
    connection_type = sqlite3.Connection

    def reader(connection: sqlite3.Connection, schema: bytes) -> bytes | None:
        if type(connection) is not connection_type and not isinstance(connection, connection_type):
            # The handle is read from the object's memory: only ever from a real one.
            raise TypeError(f"not a sqlite3.Connection: {type(connection).__name__}")
        handle = pointer_at(id(connection) + offset).value
        if not handle:
            return None  # closed
        file: bytes | None = db_filename(handle, schema)
        return file

    def handle_of(connection: sqlite3.Connection) -> int | None:
        return pointer_at(id(connection) + offset).value

    if not _self_test(handle_of, reader, vfs_find, total_changes, get_autocommit, pointer_at):
        return "a sqlite3.Connection does not hold its SQLite handle where CPython puts it"
    return _Bound(reader, db_filename, pointer_at, offset)


def _self_test(
    handle_of: Callable[[sqlite3.Connection], int | None],
    reader: FilenameReader,
    vfs_find: Callable[[bytes | None], int | None],
    total_changes: Callable[[int], int],
    get_autocommit: Callable[[int], int],
    pointer_at: Callable[[int], object],
) -> bool:
    """Whether what :func:`_bind` reads from a connection of its own behaves as its handle."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        handle = handle_of(conn)
        # struct sqlite3 begins with the connection's VFS: the default one for this connection.
        if not handle or getattr(pointer_at(handle), "value", None) != vfs_find(None):
            return False
        conn.execute("CREATE TEMP TABLE weft_probe (x)")
        conn.executemany("INSERT INTO weft_probe VALUES (?)", [(1,), (2,), (3,)])
        if total_changes(handle) != conn.total_changes or conn.total_changes != 3:
            return False
        conn.execute("BEGIN")
        in_transaction = get_autocommit(handle) == 0
        conn.execute("COMMIT")
        if not in_transaction or get_autocommit(handle) != 1:
            return False
        if reader(conn, b"main") != b"" or reader(conn, b"weft_no_such_schema") is not None:
            return False
    finally:
        conn.close()
    return handle_of(conn) is None


_found: Lazy[_Bound | str] = Lazy(_bind)
if hasattr(os, "register_at_fork"):  # a parent thread may hold its lock at fork time
    os.register_at_fork(after_in_child=_found.after_fork_in_child)
