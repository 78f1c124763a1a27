"""Session locks for SQLite stores: one ``flock``-ed file per name, next to the database.

The files live in ``<database>.weft-locks/``, one ``<encoded name>.lock`` per name. A holder keeps
an exclusive ``flock`` on its file for as long as it lives; the kernel drops it when the process
ends, however it ends. A probe opens the file read-only and tries a *shared* lock without
waiting: it gets one only if nobody holds the exclusive lock (and lets go at once). No process
id is written or compared, so a recycled PID can never make a dead holder look alive.

A missing file proves nothing (a tmp cleaner may have removed the directory under a live
holder), and neither does a file at the path that is not the one the holder locked. So a holder
writes a random nonce into its file once it holds the lock, and publishes the file's device,
inode and nonce (:attr:`SqliteSessionLock.identity`; the nonce tells a file recreated on a reused
inode from the one it locked), and
:meth:`SqliteSessionLocks.probe` answers ``FREE`` only for that same file, at the path, with no
lock on it. The directory is named after the database's real path, so every path to one store
(a symlink, a relative path) finds the same files.

``flock`` locks belong to the open file description, which a forked child shares with its
parent: an unlock in the child would drop the parent's lock, and a copy the child keeps open
would keep the lock alive after the parent died. A child therefore closes its inherited
descriptors without unlocking them (see :meth:`SqliteSessionLock._after_fork_in_child`).

The signal only works on one host, on a local file system: ``flock`` over NFS is emulated with
byte-range locks or not at all, so stores on network file systems are not supported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

from ... import _fork
from ..._fork import process_bound
from ...errors import StorageError
from ..session_locks import LockState, validate_lock_name, validate_lock_names

_log = logging.getLogger(__name__)

_SUFFIX: Final = ".lock"
# Encoded names longer than this are hashed, so that a file name stays under NAME_MAX (255).
_MAX_STEM: Final = 200
# A probe holds a shared lock for a moment; an acquirer that meets one tries again this long.
_ACQUIRE_RETRY_S: Final = 0.2
_ACQUIRE_POLL_S: Final = 0.005
# An acquirer whose file was unlinked by a releaser between open and flock starts over.
_ACQUIRE_ATTEMPTS: Final = 20


def lock_directory(database_path: str) -> str:
    """The directory holding the lock files of the database at ``database_path``.

    Named after the real path (symlinks resolved), so every path to one file finds one directory.
    """
    return os.path.realpath(database_path) + ".weft-locks"


_NONCE_BYTES: Final = 8


def file_identity(fd: int) -> str:
    """The identity of the lock file open on ``fd``: ``"<st_dev>:<st_ino>:<nonce, hex>"``."""
    st = os.fstat(fd)
    nonce = os.pread(fd, _NONCE_BYTES, 0)
    return f"{st.st_dev}:{st.st_ino}:{nonce.hex()}"


def _parse_identity(identity: str) -> tuple[int, int, bytes] | None:
    parts = identity.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    try:
        nonce = bytes.fromhex(parts[2])
    except ValueError:
        return None
    if len(nonce) != _NONCE_BYTES:
        return None
    return int(parts[0]), int(parts[1]), nonce


@functools.lru_cache(maxsize=4096)  # a watcher probes the same few names every 50 ms
def _file_name(name: str) -> str:
    stem = quote(name, safe="")
    if len(stem) > _MAX_STEM:
        import hashlib  # here, not at the top: it loads OpenSSL, which every os.fork() copies

        # ``quote`` never writes "%h", so a hashed stem cannot equal an encoded name.
        stem = "%h" + hashlib.blake2b(name.encode("utf-8"), digest_size=20).hexdigest()
    return stem + _SUFFIX


def _same_file(fd: int, path: str) -> bool | None:
    """Whether ``path`` still names the file open on ``fd`` (it was not unlinked or replaced);
    ``None`` when that cannot be told (``path`` cannot be looked up: a directory this process
    may not search any more, for example)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class SqliteSessionLock:
    """An exclusive ``flock`` on one lock file, held until :meth:`release` or process end.

    Thread-safe: ``_lock`` guards ``_fd`` and ``_released``. The calls made under it are
    non-blocking ``flock``, ``stat`` and ``unlink`` calls on a local file (a re-take in
    :meth:`ensure` retries for at most 0.2 s), never a wait for another process.
    """

    def __init__(self, name: str, path: str, fd: int) -> None:
        self._name = name
        self._path = path
        self._lock = threading.Lock()  # guards _fd and _released
        self._fd: int | None = fd
        self._identity = file_identity(fd)
        self._released = False
        self._pid = os.getpid()
        _fork.track(self)  # a forked child closes its copy

    @property
    def name(self) -> str:
        return self._name

    @property
    def token(self) -> str:
        return f"flock:{self._path}"

    @property
    def identity(self) -> str:
        """The device and inode of the file locked now (see :func:`file_identity`)."""
        with self._lock:
            return self._identity

    def ensure(self) -> bool:
        """Whether the lock is still held; re-take it if its file was removed under it.

        ``False``, with the lock kept, while the file's path cannot be looked up: whether the
        file others probe is still the locked one cannot be told, so it is not claimed held.
        Never raises.
        """
        if self._pid != os.getpid():
            return False
        error: StorageError | None = None
        with self._lock:
            if self._released:
                return False
            fd = self._fd
            same = None if fd is None else _same_file(fd, self._path)
            if same:
                return True
            undecided = fd is not None and same is None
            if not undecided:
                # The file was removed under us (or an earlier re-take failed): nobody can probe
                # the old inode, so take the lock again on a fresh file, or give up if another
                # holds it.
                try:
                    new_fd: int | None = _take(self._path)
                except StorageError as exc:
                    error, new_fd = exc, None
                self._fd = new_fd
                if new_fd is not None:
                    self._identity = file_identity(new_fd)
        if undecided:
            # The lock is kept: if the path still names its file, probes still find it held.
            _log.debug("cannot tell whether session lock file %s is still ours", self._path)
            return False
        if error is not None:
            _log.debug("re-taking the session lock %r failed: %s", self._name, error)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        return new_fd is not None

    def release(self) -> None:
        """Unlink the file, then unlock and close; idempotent. A no-op in a forked child."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._released = True
            fd, self._fd = self._fd, None
            if fd is None:
                return
            # Unlink while still holding: a prober then finds no file, never a stale unlocked one.
            if _same_file(fd, self._path):
                with contextlib.suppress(OSError):
                    os.unlink(self._path)
        _fork.untrack(self)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _after_fork_in_child(self) -> None:
        # Close only this process's descriptor: LOCK_UN would release the parent's lock.
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __repr__(self) -> str:
        state = "held" if self._fd is not None else "released"
        return f"SqliteSessionLock({self._name!r}, {state})"


def _lock_past_probes(fd: int) -> bool:
    """Lock ``fd`` exclusively, waiting out probes' shared locks (a holder's lock is for good)."""
    deadline = time.monotonic() + _ACQUIRE_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_ACQUIRE_POLL_S)


def _take(path: str) -> int:
    """Open ``path`` (created if missing) and lock it exclusively; return the descriptor.

    :raises StorageError: another process holds it, or the file cannot be opened.
    """
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the session lock directory of {path!r}: {exc}") from exc
    for _ in range(_ACQUIRE_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot open the session lock file {path!r}: {exc}") from exc
        try:
            locked = _lock_past_probes(fd)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            raise StorageError(f"the session lock file {path!r} is already held")
        if _same_file(fd, path):
            try:
                # Under the exclusive lock: whoever probes this file from now on reads this nonce.
                os.ftruncate(fd, 0)
                os.pwrite(fd, os.urandom(_NONCE_BYTES), 0)
            except OSError as exc:
                os.close(fd)
                raise StorageError(f"cannot write the session lock file {path!r}: {exc}") from exc
            return fd
        # A releaser unlinked the file between our open and our flock: start over.
        os.close(fd)
    raise StorageError(f"the session lock file {path!r} kept being replaced while taken")


class SqliteSessionLocks:
    """The session locks of one SQLite database (the methods ``SqliteStorage`` exposes).

    :param database_path: the database file; the lock files go in :func:`lock_directory`.
    :param read_only: refuse :meth:`acquire` and never create the directory.
    """

    def __init__(self, database_path: str, *, read_only: bool) -> None:
        self._directory = lock_directory(database_path)
        self._read_only = read_only

    def _path(self, name: str) -> str:
        return os.path.join(self._directory, _file_name(name))

    def acquire(self, name: str) -> SqliteSessionLock:
        """Take the lock ``name``; see ``SupportsSessionLocks.acquire_session_lock``."""
        validate_lock_name(name)
        if self._read_only:
            raise StorageError(
                f"cannot take the session lock {name!r}: the SQLite store was opened read-only"
            )
        try:
            fd = _take(self._path(name))
        except StorageError as exc:
            raise StorageError(f"cannot take the session lock {name!r}: {exc}") from exc
        return SqliteSessionLock(name, self._path(name), fd)

    def held(self, names: Collection[str]) -> set[str]:
        """Which of ``names`` are held; see ``SupportsSessionLocks.held_session_locks``."""
        return {name for name in validate_lock_names(names) if self._probe(name)}

    def probe(self, locks: Mapping[str, str | None]) -> dict[str, LockState]:
        """Judge each published identity; see ``SupportsSessionLocks.probe_session_locks``."""
        validate_lock_names(list(locks))
        return {name: self._probe_identity(name, identity) for name, identity in locks.items()}

    def _probe_identity(self, name: str, identity: str | None) -> LockState:
        path = self._path(name)
        expected = None if identity is None else _parse_identity(identity)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return LockState.UNKNOWN  # removed under its holder, or tidied after a crash
        except OSError as exc:
            raise StorageError(
                f"cannot probe the session lock {name!r} at {path!r}: {exc}"
            ) from exc
        try:
            try:
                st = os.fstat(fd)
                nonce = os.pread(fd, _NONCE_BYTES, 0)
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return LockState.HELD
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return LockState.HELD
                raise StorageError(
                    f"cannot probe the session lock {name!r} at {path!r}: {exc}"
                ) from exc
        finally:
            os.close(fd)  # closing drops the shared lock, if we got it
        if expected is None or (st.st_dev, st.st_ino, nonce) != expected:
            return LockState.UNKNOWN  # not the file its holder locked
        return LockState.FREE

    def _probe(self, name: str) -> bool:
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(
                f"cannot probe the session lock {name!r} at {path!r}: {exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return True
            raise StorageError(
                f"cannot probe the session lock {name!r} at {path!r}: {exc}"
            ) from exc
        finally:
            os.close(fd)  # closing drops the shared lock, if we got it
        return False

    def forget(self, name: str) -> None:
        """Remove the file a dead holder of ``name`` left; see ``forget_session_lock``."""
        validate_lock_name(name)
        if self._read_only:
            return
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot remove the session lock file {path!r}: {exc}") from exc
        try:
            if not _lock_past_probes(fd):
                return  # held by a live holder
            # Unlink under the exclusive lock: whoever opened this inode before must start over.
            if _same_file(fd, path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            os.close(fd)


class SqliteSessionLockMethods:
    """The ``SupportsSessionLocks`` methods of ``SqliteStorage``, kept beside their backend."""

    _session_locks: SqliteSessionLocks
    _fork_pid: int

    if TYPE_CHECKING:  # defined by the storage class this is mixed into

        def _check_open(self) -> None: ...

    @process_bound
    def acquire_session_lock(self, name: str) -> SqliteSessionLock:
        """Take the session lock ``name`` (see :class:`~.session_locks.SupportsSessionLocks`)."""
        self._check_open()
        return self._session_locks.acquire(name)

    @process_bound
    def held_session_locks(self, names: Collection[str]) -> set[str]:
        """Which of ``names`` some process holds now."""
        self._check_open()
        return self._session_locks.held(names)

    @process_bound
    def probe_session_locks(self, locks: Mapping[str, str | None]) -> dict[str, LockState]:
        """Judge the lock objects holders published (see ``SupportsSessionLocks``)."""
        self._check_open()
        return self._session_locks.probe(locks)

    @process_bound
    def forget_session_lock(self, name: str) -> None:
        """Remove the lock file a dead holder of ``name`` left behind."""
        self._check_open()
        self._session_locks.forget(name)
