"""Whether the SQLite file a storage writes to is still the store at its path.

A SQLite connection keeps using the file it opened after that file was deleted or renamed over;
its writes then land in a file no other process will ever open, while a process opening the path
gets another store (empty, or a copy) and hands out the same epochs again. Likewise a deleted
``-wal`` (or ``-shm``) file leaves this process on a log nobody else reads. So the storage checks:

- **files**, before every write transaction commits: the device and inode of the database file,
  its ``-wal`` and its ``-shm`` at the path must be the ones recorded when the storage opened
  them (a few ``stat`` calls, no I/O on the database). The storage keeps one *anchor*
  connection open for its lifetime, so SQLite never removes the ``-wal``/``-shm`` files itself
  while the storage is open (it does only when the last connection closes): a missing or
  different one means someone else removed or replaced it.
- **store id**, on every :meth:`StoreIdentity.verify` (once per maintenance pass): a random
  32-bit id kept in the database header (``PRAGMA application_id``), written once when the store
  is created and read back through a fresh connection on the path, catches a file whose content
  was overwritten in place by another store's.

Once a check fails it stays failed: every later call of the storage raises the same
:class:`~weft_sync.errors.StoreIdentityError`.

What remains: the check before a commit and the commit itself are two steps, so a file deleted
in the microseconds between them takes that one transaction with it (it is then seen by the
next check). A file replaced between the storage's first ``stat`` and SQLite's ``open`` is not
seen. A fresh store created at the path does not know the epochs an older one handed out (it
mints them from 1 again): this check makes the old engine stop instead, on its next write or
pass, and the new store logs a warning when the old one's lock file shows it replaces a deleted
store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

from .._fork import pin
from ..errors import StoreIdentityError

__all__ = ["StoreIdentity", "ensure_store_id"]

_log = logging.getLogger("weft_sync.storage.sqlite")

_SUFFIXES: Final = ("", "-wal", "-shm")
_NAMES: Final = {"": "the database file", "-wal": "its write-ahead log", "-shm": "its WAL index"}

FileId = tuple[int, int]

_SQLITE_HEADER_SIZE: Final = 100


def ensure_store_id(conn: sqlite3.Connection) -> None:
    """Give a store without one a random non-zero store id; the caller holds the write lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (current,) = conn.execute("PRAGMA application_id").fetchone()
        if not current:
            # A signed 32-bit header field: any non-zero value in range.
            store_id = secrets.randbelow(2**31 - 1) + 1
            conn.execute(f"PRAGMA application_id = {store_id:d}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _file_id(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class StoreIdentity:
    """The identity one :class:`~weft_sync.storage.sqlite.SqliteStorage` opened, and its checks.

    :param path: the database file.
    :param connect: opens a configured connection to ``path``.
    """

    def __init__(self, path: str, connect: Callable[[], sqlite3.Connection]) -> None:
        self._path = path
        self._connect = connect
        # Guards _error; the checks themselves run outside it.
        self._lock = threading.Lock()
        self._error: StoreIdentityError | None = None
        self._anchor: sqlite3.Connection | None = None
        self._files: dict[str, FileId | None] = {}
        self._store_id = 0
        # Whether the database file was seen holding at least its header (see check_truncated).
        self._had_header = False

    def open(self) -> None:
        """Open the anchor connection and record what it sees (the constructor's thread only)."""
        anchor = self._connect()
        try:
            # A read opens (and, if needed, creates) the -wal and -shm files.
            (self._store_id,) = anchor.execute("PRAGMA application_id").fetchone()
            anchor.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except BaseException:
            anchor.close()
            raise
        self._anchor = anchor
        self._files = {suffix: _file_id(self._path + suffix) for suffix in _SUFFIXES}
        self.check_truncated()

    def abandon_in_child(self, close: bool) -> None:
        """After a fork, in the child: close the inherited anchor when ``close``, else pin it
        (as the storage does with its other connections); check nothing."""
        anchor, self._anchor = self._anchor, None
        self._files = {}
        self._had_header = False
        self._lock = threading.Lock()
        if anchor is None:
            return
        if close:
            with contextlib.suppress(sqlite3.Error):
                anchor.close()
        else:
            pin(anchor)

    @property
    def store_id(self) -> int:
        """The store id recorded at open (``0``: the store has none, e.g. opened read-only)."""
        return self._store_id

    def raise_if_failed(self) -> None:
        """Raise the identity error found earlier, if any."""
        error = self._error
        if error is not None:
            raise self._copy(error)

    def check_files(self) -> None:
        """Compare the files at the path with the recorded ones (cheap: ``stat`` calls only).

        :raises StoreIdentityError: one was deleted or replaced (now, or earlier).
        """
        self.raise_if_failed()
        for suffix, recorded in self._files.items():
            if recorded is None:
                continue
            now = _file_id(self._path + suffix)
            if now != recorded:
                what = _NAMES[suffix]
                if now is None:
                    detail = f"{what} {self._path + suffix!r} was deleted"
                else:
                    detail = (
                        f"{what} {self._path + suffix!r} was replaced (device/inode "
                        f"{recorded[0]}/{recorded[1]} -> {now[0]}/{now[1]})"
                    )
                self._fail(detail)

    def check_before_commit(self) -> None:
        """The checks of every write transaction: :meth:`check_files` and
        :meth:`check_truncated` (a few ``stat`` calls).

        :raises StoreIdentityError: see those two.
        """
        self.check_files()
        self.check_truncated()

    def check_truncated(self) -> None:
        """Fail once the database file, after holding its header, holds less than one.

        ``truncate -s 0`` (or any cut below the 100-byte header) keeps the inode, so
        :meth:`check_files` does not see it, while the store's content is gone for every
        process that opens the path. A WAL-mode file may legitimately stay empty until the
        first checkpoint, and never shrinks below one page once written, so only a drop from
        "has a header" to "has none" is judged. One ``stat``.

        :raises StoreIdentityError: the file was truncated.
        """
        try:
            size = os.stat(self._path).st_size
        except FileNotFoundError:
            return  # check_files reports a deleted file
        if size >= _SQLITE_HEADER_SIZE:
            self._had_header = True
        elif self._had_header:
            self._fail(f"the database file {self._path!r} was truncated to {size} bytes")

    def verify(self) -> None:
        """Run :meth:`check_files`, then read the store id back through a fresh connection.

        :raises StoreIdentityError: the files changed, or the file holds another store.
        """
        self.check_before_commit()
        if not self._store_id:
            return
        # Read-only, so a file deleted since the check is not created again by this read.
        uri = Path(self._path).absolute().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, check_same_thread=False)
        try:
            (found,) = conn.execute("PRAGMA application_id").fetchone()
        finally:
            conn.close()
        if found != self._store_id:
            self._fail(
                f"the file now holds another store (store id {self._store_id:#x} -> {found:#x})"
            )
        self.check_files()

    def close(self) -> None:
        """Close the anchor connection (last, so SQLite may then checkpoint and tidy up)."""
        anchor, self._anchor = self._anchor, None
        if anchor is not None:
            with contextlib.suppress(sqlite3.Error):
                anchor.close()

    def _fail(self, detail: str) -> None:
        found = StoreIdentityError(self._path, detail)
        with self._lock:
            first = self._error is None
            if self._error is None:
                self._error = found
            error = self._error
        if first:
            _log.error("%s", error)
        raise self._copy(error)

    @staticmethod
    def _copy(error: StoreIdentityError) -> StoreIdentityError:
        # One object per raise, so threads raising it do not share one traceback.
        return StoreIdentityError(error.location, error.detail)
