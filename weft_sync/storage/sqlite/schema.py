"""Opening a SQLite store's file: the WAL switch, the table and store id, or their checks."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable

from ...errors import MissingStoreError, StorageError
from .identity import ensure_store_id
from .writer import WriterFileLock

# Logs under the backend's logger: its operators read one logger for the SQLite store.
_log = logging.getLogger("weft_sync.storage.sqlite.store")


def replaces_deleted_store(path: str) -> bool:
    """Whether the lock file of a store remains at ``path`` while its database is gone."""
    return os.path.exists(path + ".lock") and not os.path.exists(path)


def create_schema(
    path: str,
    table: str,
    connect: Callable[[], sqlite3.Connection],
    file_lock: WriterFileLock,
    *,
    replaces_deleted: bool,
) -> None:
    """Switch the file to WAL and create the (validated) table and the store id if missing.

    :param replaces_deleted: what :func:`replaces_deleted_store` said before the file was opened.
    :raises StorageError: the file cannot be switched to WAL.
    """
    if replaces_deleted:
        _log.warning(
            "creating a new, empty store at %r, where the lock file of a deleted one remains: "
            "its epochs start again, so every engine still running on the deleted file must be "
            "stopped (they stop writing at their next pass)",
            path,
        )
    conn = connect()
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StorageError(f"could not switch {path!r} to WAL journal mode (it is {mode!r})")
        with file_lock.hold():
            conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
            ensure_store_id(conn)
    finally:
        conn.close()


def check_schema(path: str, table: str, connect: Callable[[], sqlite3.Connection]) -> bool:
    """Check, without creating anything, that the file exists; say whether it has the table.

    :raises MissingStoreError: the file does not exist.
    """
    if not os.path.isfile(path):
        raise MissingStoreError(
            f"no SQLite store at {path!r}: the file does not exist (opened read-only, so it is "
            f"not created)"
        )
    conn = connect()
    try:
        found = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
    finally:
        conn.close()
    return found is not None
