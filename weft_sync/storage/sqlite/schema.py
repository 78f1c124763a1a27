"""Opening a SQLite store's file: the WAL switch, the table and store id, or their checks."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Final

from ...errors import MissingStoreError, StorageError
from .identity import ensure_store_id
from .writer import WriterFileLock, is_busy

_BUSY_RETRY_S: Final = 0.02

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
    busy_timeout_ms: int,
) -> None:
    """Switch the file to WAL and create the (validated) table and the store id if missing.

    :param replaces_deleted: what :func:`replaces_deleted_store` said before the file was opened.
    :param busy_timeout_ms: how long a file that stays locked is tried again.
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
    # SQLite answers "database is locked" at once, without its busy wait, while another
    # process's last connection to the file checkpoints and removes the WAL as it closes (or
    # a crashed writer's WAL is recovered): every step here is idempotent, so it is tried
    # again until the busy timeout has passed.
    deadline = time.monotonic() + busy_timeout_ms / 1000.0
    try:
        while True:
            try:
                _create(path, table, conn, file_lock)
                return
            except sqlite3.OperationalError as exc:
                # ensure_store_id rolls back its own transaction before raising.
                if not is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(_BUSY_RETRY_S)
    finally:
        conn.close()


def _create(path: str, table: str, conn: sqlite3.Connection, file_lock: WriterFileLock) -> None:
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StorageError(f"could not switch {path!r} to WAL journal mode (it is {mode!r})")
    with file_lock.hold():
        conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
        ensure_store_id(conn)


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
