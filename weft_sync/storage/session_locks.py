"""Session locks: named locks a process holds while it lives, dropped when it dies.

An optional storage capability. The lock is held by something outside the process that the
operating system or the database server tears down when the process ends: an ``flock`` on a file
next to a SQLite database (see :mod:`~weft_sync.storage.sqlite.locks`), a session-level advisory
lock on a dedicated PostgreSQL connection (see :mod:`~weft_sync.storage.postgres.locks`). Other
processes can ask which names are held without taking or disturbing them, so a lock that
disappears tells them its holder died, at once and with no clock involved.

What the signal cannot see: a frozen process (``SIGSTOP``, a debugger, a VM paused) keeps its
lock, so it looks alive; a lock can also disappear while its holder lives (a PostgreSQL session
cut by a network partition or a server restart, until :meth:`SessionLock.ensure` takes it again).
Callers must treat "not held" as evidence, never as proof that the holder stopped writing.

So a bare "not held" is never read as a crash. Each lock publishes its :attr:`SessionLock.identity`
(the lock file's device and inode; the PostgreSQL session's backend pid, the server's start time
and the name its store's sessions carry), and :meth:`SupportsSessionLocks.probe_session_locks`
answers :attr:`LockState.FREE` only when *that* lock object is provably free: the same file,
unlocked; a session that ended on a server that has not restarted since, with none of its store's
sessions left. A missing file, another inode, a restarted server or anything the probe cannot
see answers :attr:`LockState.UNKNOWN`.

Storages that offer the capability declare ``StorageCapabilities.session_locks`` and implement
:class:`SupportsSessionLocks`; :func:`storage_session_locks` finds it (``None`` for stores
without it, such as a test wrapper).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import Final, Protocol, runtime_checkable

MAX_SESSION_LOCK_NAME_LENGTH: Final = 1024


class LockState(str, enum.Enum):
    """What a probe proves about one lock object (see the module docstring)."""

    HELD = "held"
    """Some process holds the name now."""
    FREE = "free"
    """The lock object named by the identity is provably free: its holder is gone."""
    UNKNOWN = "unknown"
    """Not held, but nothing proves its holder gone (file missing or replaced, server
    restarted, another session of its store still connected, an identity that does not
    parse)."""

    def __str__(self) -> str:
        return self.value


@runtime_checkable
class SessionLock(Protocol):
    """One named lock this process holds until :meth:`release` or its own end.

    - ``name``: the name it was taken under.
    - ``token``: an opaque description of what holds it (a file path, a lock key), safe to print.
    - ``identity``: the lock object held now, as a short string a probe can check (see
      :meth:`SupportsSessionLocks.probe_session_locks`); it changes when :meth:`ensure` takes
      the lock again, and the holder publishes it again then.
    - ``ensure()``: whether it is still held; if it was lost (its database session ended) and can
      be taken again, it is, within a bounded time. Never raises for a lost lock: returns
      ``False`` (another process may have taken the name meanwhile).
    - ``release()``: let go; idempotent, never raises.

    A forked child never releases its parent's lock through an inherited instance: it only lets
    go of its copy of the underlying handle, so the parent keeps holding the lock, and the
    child's exit does not keep it alive once the parent dies.
    """

    @property
    def name(self) -> str: ...

    @property
    def token(self) -> str: ...

    @property
    def identity(self) -> str: ...

    def ensure(self) -> bool: ...

    def release(self) -> None: ...


@runtime_checkable
class SupportsSessionLocks(Protocol):
    """A store that offers :class:`SessionLock` s.

    - ``acquire_session_lock(name)`` takes the lock without waiting. Raises
      :class:`~weft_sync.errors.StorageError` naming ``name`` when another process holds it or it
      cannot be taken (a read-only store, an unreachable server). One process holding a name
      twice is refused as well.
    - ``held_session_locks(names)`` returns which of ``names`` some process holds now. It never
      takes a lock that others could notice for longer than a moment, and never disturbs a holder;
      a name never locked is not held. Raises ``StorageError`` when the store cannot be asked.
    - ``probe_session_locks(locks)`` judges each ``name -> identity`` (an identity published by
      a holder, or ``None``): :attr:`LockState.HELD` when the name is held,
      :attr:`LockState.FREE` only when that exact lock object is provably free, else
      :attr:`LockState.UNKNOWN` (always for ``None``). One probe for all; same errors as above.
    - ``forget_session_lock(name)`` tidies up what a dead holder left behind (a lock file); a
      no-op when the name is held or nothing is left.

    Names are non-empty strings of at most :data:`MAX_SESSION_LOCK_NAME_LENGTH` characters
    (``ValueError`` otherwise).
    """

    def acquire_session_lock(self, name: str) -> SessionLock: ...

    def held_session_locks(self, names: Collection[str]) -> set[str]: ...

    def probe_session_locks(self, locks: Mapping[str, str | None]) -> dict[str, LockState]: ...

    def forget_session_lock(self, name: str) -> None: ...


def storage_session_locks(storage: object) -> SupportsSessionLocks | None:
    """Return ``storage`` as a session-lock provider, or ``None`` for a store without them.

    A store offers them when it declares ``StorageCapabilities.session_locks`` *and* has the
    four methods: a wrapper that passes its inner store's capabilities through but not these
    methods (a test wrapper, say) gets ``None``, and its engines run on claim expiry alone.
    """
    capabilities = getattr(storage, "capabilities", None)
    if not getattr(capabilities, "session_locks", False):
        return None
    if not isinstance(storage, SupportsSessionLocks):
        return None
    return storage


def validate_lock_name(name: object) -> str:
    """Return ``name`` if it is a usable lock name, else raise naming it."""
    if not isinstance(name, str):
        raise TypeError(f"session lock names must be str, got {type(name).__name__} {name!r:.80}")
    if not name or len(name) > MAX_SESSION_LOCK_NAME_LENGTH:
        raise ValueError(
            f"invalid session lock name {name!r:.80}: use 1 to {MAX_SESSION_LOCK_NAME_LENGTH} "
            f"characters"
        )
    if "\x00" in name:
        raise ValueError(f"invalid session lock name {name!r:.80}: it contains a NUL character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"invalid session lock name {name!r:.80}: it is not valid Unicode text"
        ) from None
    return name


def validate_lock_names(names: Collection[str]) -> list[str]:
    """Check every name of a probe; a lone ``str`` is refused (it would be read per letter)."""
    if isinstance(names, str):
        raise TypeError(f"held_session_locks() takes a collection of names, got the str {names!r}")
    return [validate_lock_name(name) for name in names]
