"""Session locks for PostgreSQL stores: session-level advisory locks on dedicated connections.

Each held name is ``pg_try_advisory_lock(class_key, name_key)`` on a connection of its own (not
from the pool, so that no other statement ever queues behind it and a pool reset never drops
it). The server releases the lock when that session ends: the process died (its socket closed),
the backend was terminated, the server restarted, or TCP keepalives gave up on a partitioned
client (keepalives are on: about 11 s of silence unless the DSN sets its own). A partition can
therefore drop the lock while its holder still runs; :meth:`PostgresSessionLock.ensure` takes it
again once the server is reachable.

Keys: ``class_key`` derives from the table name, so that stores in different tables of one
database never see each other's locks, and ``name_key`` from the lock name, both 32-bit hashes.
Two names whose keys collide share one lock: a dead name colliding with a live one looks alive,
and a second holder of a colliding name is refused. With 32-bit keys a collision needs tens of
thousands of names held at once to become likely; a caller that judges liveness must keep a
fallback (such as a time-based expiry) for a name that looks alive but is not.

A probe is one query over ``pg_locks`` on a pooled connection; it never touches the locks.

A free lock is not proof of a dead holder: a terminated or timed-out session, a restart, a cut
connection all free it while the holder runs (and re-takes it). So each lock is held on two
sessions of its own: the lock itself, ``(class_key, name_key)``, and a *witness*,
``(witness_key, name_key)``, and publishes their backend pids with the server's start time
(``pg_postmaster_start_time()``) and its store's *tag* as its :attr:`PostgresSessionLock.identity`.
The tag is a random string of 16 hex digits drawn for each store instance and carried in the
``application_name`` of every session that instance opens (its pool's, its lock and witness
sessions', its setup sessions'; see :func:`tagged_application_name`); ``application_name`` is
shown in ``pg_stat_activity`` to every role, for every session.

:meth:`PostgresSessionLockMethods.probe_session_locks` answers ``FREE`` only when neither key is
held, neither backend is still connected (``pg_stat_activity``), no session carrying the store's
tag is connected, and the server has not restarted since the lock was taken: what the server sees
when the holder's process died and the kernel closed all of its sockets. One lock session
terminated (``pg_terminate_backend``, a timeout) leaves the other; both terminated leave the
store's pooled sessions, which a live engine uses at every renewal (so an idle-session killer
spares them): ``UNKNOWN`` either way, and :meth:`PostgresSessionLock.ensure` takes what was lost
again. Where the tag check stops: the pool may have no connection at the moment of a probe (all
of them ended at once, and none reopened yet), and then a live engine whose lock and witness
sessions also ended at that moment is judged ``FREE``. The pool keeps ``min_size`` (at least one)
connection, so that needs every session of the engine ended together, which is what a crash
looks like to the server; the tag only ever turns a ``FREE`` into ``UNKNOWN``, never the reverse.
A wrong ``FREE`` moves claims early but never lets two owners write (takeovers and writes are
fenced), and the deposed engine learns it at its next renewal.

An identity of three fields (``"<lock pid>:<witness pid>:<server start, us>"``), as engines
without a tag publish, is judged on the two sessions alone.

Behind a transaction-mode pooler the store offers no session locks (its capabilities say so),
so nothing is probed there; the tag is still sent, and only names the client's sessions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

from ... import _fork
from ..._fork import pin, process_bound
from ...errors import StorageError
from ...redaction import redact_text
from ..session_locks import LockState, validate_lock_name, validate_lock_names

_Conn = psycopg.Connection[TupleRow]

# libpq keepalive settings for lock connections, unless the DSN sets its own.
_KEEPALIVES: Final = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
_START_US: Final = "(extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8"
# current_setting(..., true) is NULL on a server without the setting (before PostgreSQL 14).
_TRY_LOCK: Final = (
    f"SELECT pg_try_advisory_lock(%s::int4, %s::int4), pg_backend_pid(), {_START_US}, "
    "current_setting('idle_session_timeout', true)"
)
_UNLOCK: Final = "SELECT pg_advisory_unlock(%s::int4, %s::int4)"
# pg_locks shows the two int4 keys of a two-key advisory lock as oids (unsigned): classid holds
# the first, objid the second, and objsubid is 2.
_STILL_MINE: Final = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() "
    "AND locktype = 'advisory' AND classid = %s::oid AND objid = %s::oid "
    "AND objsubid = 2 AND granted)"
)
_PROBE: Final = (
    "SELECT DISTINCT objid::int8 FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::oid AND objsubid = 2 AND granted AND objid = ANY(%s::oid[])"
)

# Which lock and witness keys of the probed names are held, which of the published backends are
# still connected, which published store tags some connected session carries, and when the
# server started: one statement. pg_locks is read once and pg_stat_activity at most once (each
# CTE, referenced twice, is materialised), and pg_stat_activity only when some probed lock is not
# held (a one-time filter): its sessions matter only for those, and a probe of live engines, the
# usual one, then reads nothing more. strpos, not LIKE: a tag is matched as a plain substring.
_PROOF: Final = (
    "WITH held AS (SELECT DISTINCT classid::int8 AS class, objid::int8 AS obj FROM pg_locks "
    "WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = ANY(%s::oid[]) AND objsubid = 2 AND granted AND objid = ANY(%s::oid[])), "
    "act AS (SELECT pid, application_name FROM pg_stat_activity "
    "WHERE (SELECT count(*) FROM held WHERE class = %s) < %s) "
    f"SELECT {_START_US}, "
    "ARRAY(SELECT obj FROM held WHERE class = %s), "
    "ARRAY(SELECT obj FROM held WHERE class = %s), "
    "ARRAY(SELECT pid FROM act WHERE pid = ANY(%s::int4[])), "
    "ARRAY(SELECT DISTINCT tag FROM unnest(%s::text[]) AS tag JOIN act "
    "ON strpos(act.application_name, tag) > 0)"
)

_TAG: Final = re.compile(r"[0-9a-f]{16}")
# PostgreSQL keeps the first NAMEDATALEN - 1 bytes of an application_name.
_MAX_APPLICATION_NAME: Final = 63
_DEFAULT_APPLICATION_NAME: Final = "weft_sync"


def new_store_tag() -> str:
    """A fresh random tag for one store instance: 16 lowercase hex digits."""
    return secrets.token_hex(8)


def tagged_application_name(own: str | None, tag: str) -> str:
    """The ``application_name`` of a store's sessions: ``own`` (or ``weft_sync``), a space, ``tag``.

    ``own`` is the caller's own ``application_name`` (the DSN's, else ``PGAPPNAME``), cut so that
    the whole fits the server's 63 bytes, its characters other than printable ASCII replaced by
    ``?`` first: the server would otherwise escape them into longer text and cut the tag off.
    """
    prefix = "".join(c if " " <= c <= "~" else "?" for c in own) if own else ""
    prefix = prefix[: _MAX_APPLICATION_NAME - len(tag) - 1] or _DEFAULT_APPLICATION_NAME
    return f"{prefix} {tag}"


def _key32(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


def lock_keys(table: str, name: str) -> tuple[int, int]:
    """The signed ``(class_key, name_key)`` int4 pair of lock ``name`` on store ``table``."""
    return _key32(f"weft_sync.session-lock:{table}"), _key32(name)


def witness_keys(table: str, name: str) -> tuple[int, int]:
    """The ``(witness_key, name_key)`` pair the witness session of lock ``name`` holds."""
    return _key32(f"weft_sync.session-witness:{table}"), _key32(name)


def _oid(key: int) -> int:
    return key & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    """A published lock identity, parsed.

    :param lock_pid: the lock session's backend pid (``0``: lost when published).
    :param witness_pid: the witness session's backend pid (``0``: lost when published).
    :param started_us: the server's start time, in microseconds since the epoch.
    :param tag: the tag its store's sessions carry; ``None`` for a three-field identity.
    """

    lock_pid: int
    witness_pid: int
    started_us: int
    tag: str | None = None


def session_identity(
    lock_pid: int, witness_pid: int, started_us: int, tag: str | None = None
) -> str:
    """The published identity of a lock: ``"<lock pid>:<witness pid>:<server start, us>:<tag>"``
    (without ``tag``, the first three fields alone)."""
    base = f"{lock_pid}:{witness_pid}:{started_us}"
    return base if tag is None else f"{base}:{tag}"


def parse_session_identity(identity: str) -> SessionIdentity | None:
    """The fields of a published identity of three or four fields, or ``None`` if malformed."""
    parts = identity.split(":")
    if len(parts) not in (3, 4) or not all(p.isascii() and p.isdigit() for p in parts[:3]):
        return None
    tag = parts[3] if len(parts) == 4 else None
    if tag is not None and not _TAG.fullmatch(tag):
        return None
    return SessionIdentity(int(parts[0]), int(parts[1]), int(parts[2]), tag)


_Taken = tuple[_Conn, int, int]
"""A session holding one key: ``(connection, backend pid, server start in us)``."""


class PostgresSessionLock:
    """An advisory lock held on a lock session and a witness session, re-taken if lost.

    Thread-safe: ``_lock`` guards ``_slots`` and ``_released``. ``ensure`` and ``release`` talk
    to the server under it, bounded by the sessions' ``statement_timeout`` and the
    ``connect_timeout``; nothing else ever waits for that lock but another call on this object.
    """

    def __init__(
        self,
        name: str,
        table: str,
        taken: tuple[_Taken, _Taken],
        connect: Any,
        keys: tuple[tuple[int, int], tuple[int, int]],
        guard: Any = None,
        tag: str | None = None,
    ) -> None:
        self._guard = guard if guard is not None else (lambda _conn: contextlib.nullcontext())
        self._name = name
        self._tag = tag
        self._table = table
        self._keys = keys
        self._connect = connect
        self._lock = threading.Lock()  # guards _slots and _released
        # [lock session, witness session]; None for one lost and not taken again yet.
        self._slots: list[_Taken | None] = list(taken)
        self._released = False
        self._pid = os.getpid()
        _fork.track(self)  # a forked child closes its copy

    @property
    def name(self) -> str:
        return self._name

    @property
    def token(self) -> str:
        key = self._keys[0]
        return f"pg_advisory_lock({key[0]}, {key[1]}) on table {self._table}"

    @property
    def identity(self) -> str:
        """The two sessions holding the lock now and the store's tag (see
        :func:`session_identity`)."""
        with self._lock:
            lock, witness = self._slots
        return session_identity(
            lock[1] if lock else 0, witness[1] if witness else 0, lock[2] if lock else 0, self._tag
        )

    def ensure(self) -> bool:
        """Whether the lock session still holds the lock; re-take whatever session was lost.

        The witness is re-taken too (a failure there is not fatal: it only weakens the proof a
        probe can draw until the next call).
        """
        if self._pid != os.getpid():
            return False
        with self._lock:
            if self._released:
                return False
            for slot in (0, 1):
                self._ensure_slot(slot)
            return self._slots[0] is not None

    def _ensure_slot(self, slot: int) -> None:
        taken = self._slots[slot]
        if taken is not None:
            with self._guard(taken[0]):
                if _still_mine(taken[0], self._keys[slot]):
                    return
        self._slots[slot] = None
        if taken is not None:
            with contextlib.suppress(Exception):
                taken[0].close()
        with contextlib.suppress(StorageError):  # None until a later call takes it
            self._slots[slot] = _take(self._connect, self._keys[slot], self._name)

    def release(self) -> None:
        """Unlock and close both sessions; idempotent, never raises. A no-op in a forked child."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._released = True
            slots, self._slots = self._slots, [None, None]
        _fork.untrack(self)
        for slot, taken in enumerate(slots):
            if taken is None:
                continue
            # Unlock first: closing alone returns before the server has ended the session, and
            # a caller that releases and then probes must find the name free.
            with contextlib.suppress(psycopg.Error):
                taken[0].execute(_UNLOCK, list(self._keys[slot]))
            with contextlib.suppress(Exception):
                taken[0].close()

    def _after_fork_in_child(self) -> None:
        # Close the child's copies of the sockets, sending nothing (a Terminate message would
        # end the parent's sessions); the connection objects are pinned, never finalised.
        slots, self._slots = self._slots, [None, None]
        self._released = True
        self._lock = threading.Lock()
        for taken in slots:
            if taken is not None:
                pin(taken[0])
                with contextlib.suppress(Exception):
                    os.close(taken[0].pgconn.socket)

    def __repr__(self) -> str:
        return f"PostgresSessionLock({self._name!r}, {self.token})"


def _still_mine(conn: _Conn, keys: tuple[int, int]) -> bool:
    try:
        row = conn.execute(_STILL_MINE, [_oid(keys[0]), _oid(keys[1])]).fetchone()
    except psycopg.Error:
        return False
    return bool(row and row[0])


def _take(connect: Any, keys: tuple[int, int], name: str) -> _Taken:
    """Open a dedicated session and take ``keys`` on it; return it with its pid and start time.

    :raises StorageError: the server cannot be reached, or another session holds the lock.
    """
    try:
        conn: _Conn = connect()
    except psycopg.Error as exc:
        raise StorageError(
            f"cannot take the session lock {name!r}: connecting failed: {redact_text(str(exc))}"
        ) from exc
    try:
        row = conn.execute(_TRY_LOCK, list(keys)).fetchone()
    except psycopg.Error as exc:
        conn.close()
        raise StorageError(
            f"cannot take the session lock {name!r}: {redact_text(str(exc))}"
        ) from exc
    if not (row and row[0]):
        conn.close()
        raise StorageError(
            f"cannot take the session lock {name!r}: another session holds it (or a name "
            f"whose key {keys[1]} collides with it)"
        )
    if row[3] not in (None, "0"):
        # The server would end the idle lock session, which reads as a crash to nobody but
        # costs the lock: refused, so the engine says it runs without one.
        conn.close()
        raise StorageError(
            f"cannot take the session lock {name!r}: its session runs with idle_session_timeout "
            f"= {row[3]!r} (the DSN's options set it?); the lock session needs 0"
        )
    return conn, int(row[1]), int(row[2])


class PostgresSessionLockMethods:
    """The ``SupportsSessionLocks`` methods of ``PostgresStorage``, kept beside their backend."""

    _dsn: str
    _table: str
    _read_only: bool
    _connect_kwargs: dict[str, Any]
    _fork_pid: int
    _tag: str

    if TYPE_CHECKING:  # defined by the storage class this is mixed into

        def _check_open(self) -> None: ...

        def _read(self, action: str, query: Any, params: Sequence[object]) -> list[TupleRow]: ...

        def guard_call(self, conn: _Conn) -> contextlib.AbstractContextManager[None]: ...

    def _lock_connect(self) -> _Conn:
        own = conninfo_to_dict(self._dsn)
        kwargs = dict(self._connect_kwargs)
        kwargs.update({k: v for k, v in _KEEPALIVES.items() if k not in own})
        return psycopg.connect(self._dsn, **kwargs)

    @process_bound
    def acquire_session_lock(self, name: str) -> PostgresSessionLock:
        """Take the session lock ``name`` (see :class:`~.session_locks.SupportsSessionLocks`)."""
        validate_lock_name(name)
        self._check_open()
        if self._read_only:
            raise StorageError(
                f"cannot take the session lock {name!r}: the PostgreSQL store was opened read-only"
            )
        keys = (lock_keys(self._table, name), witness_keys(self._table, name))
        taken = _take(self._lock_connect, keys[0], name)
        try:
            witness = _take(self._lock_connect, keys[1], name)
        except BaseException:
            with contextlib.suppress(Exception):
                taken[0].close()
            raise
        return PostgresSessionLock(
            name,
            self._table,
            (taken, witness),
            self._lock_connect,
            keys,
            self.guard_call,
            self._tag,
        )

    @process_bound
    def held_session_locks(self, names: Collection[str]) -> set[str]:
        """Which of ``names`` some session holds now (one query over ``pg_locks``)."""
        checked = validate_lock_names(names)
        self._check_open()
        if not checked:
            return set()
        class_key = lock_keys(self._table, "")[0]
        by_oid: dict[int, list[str]] = {}
        for name in checked:
            by_oid.setdefault(_oid(_key32(name)), []).append(name)
        rows = self._read("session lock probe", _PROBE, [_oid(class_key), list(by_oid)])
        return {name for (objid,) in rows for name in by_oid.get(int(objid), ())}

    @process_bound
    def probe_session_locks(self, locks: Mapping[str, str | None]) -> dict[str, LockState]:
        """Judge the lock sessions holders published, in one query (see the module docstring)."""
        checked = validate_lock_names(list(locks))
        self._check_open()
        if not checked:
            return {}
        parsed = {
            name: None if identity is None else parse_session_identity(identity)
            for name, identity in locks.items()
        }
        proofs = [p for p in parsed.values() if p is not None]
        pids = sorted({pid for p in proofs for pid in (p.lock_pid, p.witness_pid) if pid})
        tags = sorted({p.tag for p in proofs if p.tag is not None})
        lock_class = _oid(lock_keys(self._table, "")[0])
        witness_class = _oid(witness_keys(self._table, "")[0])
        oids = sorted({_oid(_key32(name)) for name in checked})
        ((started, held, witnessed, alive, tagged),) = self._read(
            "session lock probe",
            _PROOF,
            [
                [lock_class, witness_class],
                oids,
                lock_class,
                len(oids),
                lock_class,
                witness_class,
                pids,
                tags,
            ],
        )
        held_oids = {int(oid) for oid in held}
        witnessed_oids = {int(oid) for oid in witnessed}
        alive_pids = {int(pid) for pid in alive}
        alive_tags = {str(tag) for tag in tagged}
        states: dict[str, LockState] = {}
        for name, proof in parsed.items():
            oid = _oid(_key32(name))
            if oid in held_oids:
                states[name] = LockState.HELD
            elif (
                proof is None
                or oid in witnessed_oids  # the lock session is being re-taken
                or proof.started_us != int(started)  # the server restarted since: nothing known
                or not proof.lock_pid
                or not proof.witness_pid  # published while a session was lost: no proof
                or proof.lock_pid in alive_pids
                or proof.witness_pid in alive_pids
                or proof.tag in alive_tags  # another session of its store is still connected
            ):
                states[name] = LockState.UNKNOWN
            else:
                states[name] = LockState.FREE
        return states

    @process_bound
    def forget_session_lock(self, name: str) -> None:
        """Nothing to tidy: the server forgets a lock when its session ends."""
        validate_lock_name(name)
        self._check_open()
