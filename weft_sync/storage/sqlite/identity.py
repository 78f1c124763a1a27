"""Whether the SQLite file a storage writes to is still the store at its path.

A SQLite connection keeps using the file it opened after that file was deleted or renamed over;
its writes then land in a file no other process will ever open, while a process opening the path
gets another store (empty, or a copy) and hands out the same epochs again. Likewise a deleted
``-wal`` (or ``-shm``) file leaves this process on a log nobody else reads. So the storage checks:

- **files**, before every write transaction commits: the device and inode of the database file,
  its ``-wal`` and its ``-shm`` at the path must be the ones recorded when the storage opened
  them (``stat`` calls, no I/O on the database). The storage keeps one *anchor* connection open
  for its lifetime, so SQLite never removes the ``-wal``/``-shm`` files itself while the storage
  is open (it does only when the last connection closes): a missing or different one means
  someone else removed or replaced it. The database file is looked at on every commit. The
  ``-wal`` and ``-shm`` are looked at whenever their directory changed since they were last
  found intact: deleting, renaming or creating a name changes the directory's modification and
  change times, and a directory stamp (device, inode, both times) read before a full check that
  passed stands for the names in it until it changes. Why not simply ``stat`` the log each time:
  on kernels with fine-grained timestamps on demand (Linux 6.13 and later), reading a file's
  times makes its next write update them, so every commit's ``fdatasync`` of a log that was just
  looked at also writes its inode: a quarter of a small commit's time on a local disk. A stamp
  is trusted only once the directory's last change is :data:`DIR_STAMP_MARGIN_NS` older than
  the moment it was read, so that a change in the same timestamp tick cannot leave the times as
  they were (file systems with coarse, even 2 s, timestamps included); until then every commit
  looks at both files.
- **store id**, on every :meth:`StoreIdentity.verify` (once per maintenance pass): a random
  32-bit id kept in the database header (``PRAGMA application_id``), written once when the store
  is created and read back through a fresh connection on the path, catches a file whose content
  was overwritten in place by another store's, and one whose header was overwritten with
  something that is not a database at all (read twice, through two connections, before it
  counts: the engine's own connections keep working on what SQLite cached of the file).

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
import fcntl
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, NoReturn

from ..._fork import pin
from ...errors import StorageError, StoreIdentityError

_log = logging.getLogger("weft_sync.storage.sqlite.store")

_SUFFIXES: Final = ("", "-wal", "-shm")
_NAMES: Final = {"": "the database file", "-wal": "its write-ahead log", "-shm": "its WAL index"}

FileId = tuple[int, int]

_SQLITE_HEADER_SIZE: Final = 100
_SQLITE_NOTADB: Final = 26

DIR_STAMP_MARGIN_NS = 3_000_000_000
"""How much older than its reading the directory's last change must be for its stamp to stand
for the ``-wal`` and ``-shm`` names (see the module docstring)."""

DirStamp = tuple[int, int, int, int]


def ensure_store_id(conn: sqlite3.Connection) -> None:
    """Give a store without one a random non-zero store id; the caller holds the write lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (current,) = conn.execute("PRAGMA application_id").fetchone()
        if not current:
            # A signed 32-bit header field: any non-zero value in range.
            store_id = int.from_bytes(os.urandom(4), "big") % (2**31 - 1) + 1
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
    """The identity one :class:`~weft_sync.storage.SqliteStorage` opened, and its checks.

    :param path: the database file.
    :param connect: opens a configured connection to ``path``.
    """

    def __init__(self, path: str, connect: Callable[[], sqlite3.Connection]) -> None:
        self._path = path
        self._dir = os.path.dirname(os.path.abspath(path))
        self._connect = connect
        # Guards _error; the checks themselves run outside it.
        self._lock = threading.Lock()
        self._error: StoreIdentityError | None = None
        self._anchor: sqlite3.Connection | None = None
        self._files: dict[str, FileId | None] = {}
        # The directory stamp the last full check passed under (None: not trusted yet). Read and
        # written without a lock: a tuple is replaced whole, and a stale one only costs a check.
        self._dir_stamp: DirStamp | None = None
        self._store_id = 0
        # Whether the database file was seen holding at least its header (see check_truncated).
        self._had_header = False
        self._open_path: OpenPath | None = None

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

    def register_path(self, open_path: OpenPath) -> None:
        """Publish this path (see :class:`OpenPath`) on the anchor connection; after :meth:`open`.

        :raises StoreIdentityError: an engine has the file open through another path.
        """
        assert self._anchor is not None
        open_path.register(self._anchor)
        self._open_path = open_path

    def abandon_in_child(self, close: bool) -> None:
        """After a fork, in the child: close the inherited anchor when ``close``, else pin it
        (as the storage does with its other connections); check nothing."""
        open_path, self._open_path = self._open_path, None
        if open_path is not None:
            open_path.close_in_child()
        anchor, self._anchor = self._anchor, None
        self._files = {}
        self._dir_stamp = None
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
        self._check_files()

    def _check_files(self) -> int | None:
        """:meth:`check_files`; return the database file's size (``None``: no file)."""
        self.raise_if_failed()
        size = None
        for suffix, recorded in self._files.items():
            if recorded is None:
                continue
            try:
                st = os.stat(self._path + suffix)
            except FileNotFoundError:
                now = None
            else:
                now = st.st_dev, st.st_ino
                if not suffix:
                    size = st.st_size
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
        return size

    def check_database_file(self) -> None:
        """The fence's check before a host's commit: one ``stat`` of the database file, against
        the one recorded (the ``-wal`` and ``-shm`` are the store's own commits' to check).

        :raises StoreIdentityError: the file was deleted or replaced (now, or earlier).
        """
        self.raise_if_failed()
        if self._files.get("") is not None:
            self._stat_database_file()

    def check_before_commit(self) -> None:
        """The checks of every write transaction: :meth:`check_files` and
        :meth:`check_truncated`; the ``-wal`` and ``-shm`` only when their directory changed
        (see the module docstring).

        :raises StoreIdentityError: see those two.
        """
        self.raise_if_failed()
        if self._files.get("") is None or self._dir_stamp is None:
            self._full_check()
            return
        st = self._stat_database_file()
        if st is None:
            return
        self._judge_size(st.st_size)
        if self._read_dir_stamp() != self._dir_stamp:
            self._full_check()

    def _stat_database_file(self) -> os.stat_result | None:
        """The database file's ``stat`` when it is the recorded one; else a full check (which
        reports it deleted or replaced) and ``None``."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._full_check()  # reports the deleted file
            return None
        if (st.st_dev, st.st_ino) != self._files.get(""):
            self._full_check()  # reports the replaced file
            return None
        return st

    def _full_check(self) -> None:
        """Every file, then the size; remember the directory stamp read first if it is old
        enough to stand for the names in it."""
        stamp = self._read_dir_stamp()
        now_ns = time.time_ns()
        size = self._check_files()
        if size is None:
            self.check_truncated()  # the database file's id was not recorded: stat it here
        else:
            self._judge_size(size)
        trusted = stamp is not None and now_ns - max(stamp[2], stamp[3]) > DIR_STAMP_MARGIN_NS
        self._dir_stamp = stamp if trusted else None

    def _read_dir_stamp(self) -> DirStamp | None:
        try:
            st = os.stat(self._dir)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns

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
        self._judge_size(size)

    def _judge_size(self, size: int) -> None:
        if size >= _SQLITE_HEADER_SIZE:
            self._had_header = True
        elif self._had_header:
            self._fail(f"the database file {self._path!r} was truncated to {size} bytes")

    def verify(self) -> None:
        """Run :meth:`check_files`, then read the store id back through a fresh connection.

        :raises StoreIdentityError: the files changed, or the file holds another store.
        """
        self._full_check()
        if not self._store_id:
            return
        try:
            found = self._read_store_id()
        except sqlite3.DatabaseError as exc:
            if not _not_a_database(exc):
                raise
            # Read again through another connection: a header caught in the middle of a write
            # reads differently the second time, one that was overwritten reads the same.
            try:
                found = self._read_store_id()
            except sqlite3.DatabaseError as again:
                if not _not_a_database(again):
                    raise
                self._fail(
                    f"the file no longer holds a SQLite database (its header was overwritten "
                    f"in place: {again}); this engine's own connection still reads its cache"
                )
        if found != self._store_id:
            self._fail(
                f"the file now holds another store (store id {self._store_id:#x} -> {found:#x})"
            )
        self.check_files()

    def _read_store_id(self) -> int:
        # Read-only, so a file deleted since the check is not created again by this read.
        uri = Path(self._path).absolute().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, check_same_thread=False)
        try:
            (found,) = conn.execute("PRAGMA application_id").fetchone()
        finally:
            conn.close()
        return int(found)

    def close(self) -> None:
        """Close the anchor connection (last, so SQLite may then checkpoint and tidy up)."""
        open_path, self._open_path = self._open_path, None
        if open_path is not None:
            open_path.close()
        anchor, self._anchor = self._anchor, None
        if anchor is not None:
            with contextlib.suppress(sqlite3.Error):
                anchor.close()

    def _fail(self, detail: str) -> NoReturn:
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
        return StoreIdentityError(error.location, error.detail, at_open=error.at_open)


def _not_a_database(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite refused the file as not a database (``SQLITE_NOTADB``)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return (int(code) & 0xFF) == _SQLITE_NOTADB
    return str(exc).startswith("file is not a database")


# -- one store, one path -------------------------------------------------------------------------
#
# SQLite names a database's -wal and -shm files after the path it was opened by, and weft's
# writer lock and session locks live next to that path too. The same file reached through a hard
# link or a bind-mounted path therefore gets a log and locks of its own: two engines each alone in
# their WAL both own a claim, and the file ends up corrupt. So a store is refused when its file
# has more than one name (st_nlink > 1), or when an engine has it open through another path.
#
# Every open publishes its real path, device and inode in the table below (checkpointed at once,
# so that an engine on another WAL of the same file reads it from the main file), and keeps a
# shared flock on an "open" mark next to that path (``<real path>.weft-open``) while it is open.
# A path row whose file is this same file and whose mark is locked names an engine that has the
# store open through that other path now. Rows left by engines that are gone are removed.

_PATHS_TABLE: Final = "weft_open_paths"
RESERVED_TABLES: Final = frozenset({_PATHS_TABLE})
"""Tables of the store's database file that the store keeps for itself (names compared
case-insensitively, as SQLite compares them): a store's own table may not take one of them."""
_OPEN_MARK: Final = ".weft-open"


def refuse_second_name(path: str) -> None:
    """Refuse a database file that has more than one hard link, naming the others found.

    :raises StoreIdentityError: the file at ``path`` has ``st_nlink > 1``.
    """
    try:
        st = os.stat(path)
    except OSError:
        return  # no file yet (or no path to one): opening it says what is wrong
    if not stat.S_ISREG(st.st_mode) or st.st_nlink <= 1:  # a directory's links are not names
        return
    others: list[str] = []
    with contextlib.suppress(OSError):
        directory = os.path.dirname(os.path.realpath(path))
        for entry in os.scandir(directory):
            if entry.inode() == st.st_ino and entry.path != os.path.realpath(path):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_dev == st.st_dev:
                        others.append(entry.path)
    also = f" (also {', '.join(repr(o) for o in sorted(others))})" if others else ""
    raise StoreIdentityError(
        path,
        f"the database file has {st.st_nlink} hard links{also}: SQLite names its write-ahead "
        f"log after the path, so engines opening it by different names would each write a log "
        f"of their own and could both own a claim; open it through one name only",
        at_open=True,
    )


def _mark_held_by_others(mark: str) -> bool:
    """Whether some process holds a shared flock on ``mark`` (an exclusive try fails)."""
    try:
        fd = os.open(mark, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


class OpenPath:
    """This storage's entry in the store's table of open paths, and its ``open`` mark.

    :param path: the database path the storage was given.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._real = os.path.realpath(path)
        self._mark = self._real + _OPEN_MARK
        self._fd: int | None = None

    def register(self, conn: sqlite3.Connection) -> None:
        """Refuse a store open through another path; else publish this path and hold the mark.

        :raises StoreIdentityError: an engine has this file open through another path now.
        :raises StorageError: the file or its mark cannot be reached.
        """
        try:
            self._register(conn)
        except OSError as exc:
            raise StorageError(f"cannot record the path {self._path!r} is open by: {exc}") from exc

    def _register(self, conn: sqlite3.Connection) -> None:
        st = os.stat(self._real)
        mine = (st.st_dev, st.st_ino)
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_PATHS_TABLE} "
            "(path TEXT PRIMARY KEY, dev INTEGER NOT NULL, ino INTEGER NOT NULL)"
        )
        rows = conn.execute(f"SELECT path, dev, ino FROM {_PATHS_TABLE}").fetchall()
        stale: list[str] = []
        for other, dev, ino in rows:
            if other == self._real:
                continue
            same_file = _file_id(other) == mine and (dev, ino) == mine
            if same_file and _mark_held_by_others(os.path.realpath(other) + _OPEN_MARK):
                raise StoreIdentityError(
                    self._path,
                    f"the same database file (device/inode {mine[0]}/{mine[1]}) is open through "
                    f"{other!r} by another engine, and SQLite keeps a write-ahead log per path: "
                    f"open it through {other!r} too, or through one path only",
                    at_open=True,
                )
            stale.append(other)
        with conn:
            conn.executemany(f"DELETE FROM {_PATHS_TABLE} WHERE path = ?", [(p,) for p in stale])
            conn.execute(
                f"INSERT OR REPLACE INTO {_PATHS_TABLE} (path, dev, ino) VALUES (?, ?, ?)",
                (self._real, *mine),
            )
        # Into the main file now: an engine on another path's WAL reads only what is there.
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        fd = os.open(self._mark, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._fd = fd

    def close(self) -> None:
        """Let go of the mark (the row stays: it is removed by the next open that finds it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_in_child(self) -> None:
        """In a forked child: close the inherited descriptor without unlocking (shared flock)."""
        self.close()
