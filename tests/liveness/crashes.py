"""A lock object provably left by a dead holder, made in the test's own process.

A crash verdict needs proof that the very lock object an engine published is free; a name
nobody ever locked proves nothing. :func:`dead_lock` makes such proof for real:

- SQLite: the lock is taken, then its descriptor closed without unlocking or unlinking, as the
  kernel does for a killed holder: the same file stays at the path, unlocked.
- PostgreSQL: the lock is taken by a second store of its own, which is then closed, so the lock
  session and every session carrying that store's token are gone (waited for, bounded).
"""

from __future__ import annotations

import time

from tests.support.waiting import wait_until
from weft_sync.storage import PostgresStorage, SqliteStorage, Storage
from weft_sync.storage.session_locks import (
    LockState,
    SupportsSessionLocks,
    storage_session_locks,
)

_GONE_WITHIN_S = 10.0


def dead_lock(storage: Storage, name: str) -> str:
    """Leave behind the lock ``name`` of a holder that died; return the identity it published."""
    locks = storage_session_locks(storage)
    assert locks is not None
    if isinstance(storage, SqliteStorage):
        lock = locks.acquire_session_lock(name)
        identity = lock.identity
        lock._after_fork_in_child()  # type: ignore[attr-defined]
        return identity
    assert isinstance(storage, PostgresStorage)
    other = PostgresStorage(storage._dsn, table=storage._table)
    try:
        lock = other.acquire_session_lock(name)
        identity = lock.identity
        lock.release()
    finally:
        other.close()
    wait_until(
        lambda: locks.probe_session_locks({name: identity})[name] is LockState.FREE,
        "the closed store's sessions to end",
        timeout_s=_GONE_WITHIN_S,
        poll_s=0.01,
    )
    return identity


WATCH_S = 1.0
"""How long :func:`states_seen` probes."""


def states_seen(locks: SupportsSessionLocks, name: str, identity: str) -> set[LockState]:
    """Probe lock ``name`` by ``identity`` for :data:`WATCH_S`; return every state seen (a test
    that must never see ``FREE`` asserts on the set)."""
    seen: set[LockState] = set()
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        seen.add(locks.probe_session_locks({name: identity})[name])
        time.sleep(0.01)
    return seen
