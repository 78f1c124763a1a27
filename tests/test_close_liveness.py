"""What ``Ownership.close()`` leaves of an engine's liveness: its record and its session lock.

A clean close removes the record and lets go of the lock. A close that could not release every
claim (the store refuses the writes) leaves the record in state ``"closed"`` with the count
left, so that another engine takes those claims over at once instead of after their TTL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from tests.claims.gated import WarningSink
from tests.engines import opened_engines
from tests.maintenance.discovery_helpers import (
    JOB,
    OPTIONS,
    RENEW_MS,
    Driven,
    engine_record,
    holders,
)
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.clock import ManualClock
from weft_sync.errors import StorageError
from weft_sync.storage import Storage
from weft_sync.storage.base import Batch
from weft_sync.storage.session_locks import storage_session_locks

START = 1_000_000


def _lock_held(storage: Storage, name: str) -> bool:
    locks = storage_session_locks(storage)
    assert locks is not None
    return name in locks.held_session_locks([name])


class RefusingWrites:
    """Forwards to a real store; while ``refuse`` is set, every conditional write raises."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        self._flag = threading.Event()  # set: refuse conditional writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    def refuse(self) -> None:
        self._flag.set()

    def _check(self) -> None:
        if self._flag.is_set():
            raise StorageError("injected: the store refuses conditional writes")

    def conditional_batch(self, conditions: Sequence[Any], operations: Sequence[Any]) -> bool:
        self._check()
        return bool(self._inner.conditional_batch(conditions, operations))

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        self._check()
        return self._inner.conditional_batches(batches)

    def compare_and_set_many(self, rows: Sequence[Any]) -> list[bool]:
        self._check()
        method = self._inner.compare_and_set_many  # type: ignore[attr-defined]
        result: list[bool] = method(rows)
        return result


def test_close_removes_the_record_and_releases_the_session_lock(storage: Storage) -> None:
    clock = ManualClock(START)
    ownership = Ownership.open(
        storage, engine_id="engine-a", options=OPTIONS, clock=clock, background="manual"
    )
    ownership.workflows.start("wf-1", JOB)
    assert engine_record(storage, "engine-a") is not None
    assert _lock_held(storage, "engine-a")

    ownership.close()

    assert engine_record(storage, "engine-a") is None
    assert not _lock_held(storage, "engine-a")
    assert holders(storage, ["wf-1"]) == {"wf-1": None}


def test_a_running_engine_stops_its_crash_probe_and_releases_everything_at_close(
    storage: Storage,
) -> None:
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    ownership = Ownership.open(storage, engine_id="engine-t", options=options)
    ownership.start()
    assert "weft-liveness-watch" in {t.name for t in threading.enumerate()}
    record = engine_record(storage, "engine-t")
    assert record is not None and record.watching

    ownership.close()

    assert "weft-liveness-watch" not in {t.name for t in threading.enumerate()}
    assert engine_record(storage, "engine-t") is None
    assert not _lock_held(storage, "engine-t")


def test_claims_a_close_could_not_release_are_taken_over_before_they_expire(
    storage: Storage,
) -> None:
    clock = ManualClock(START)
    refusing = RefusingWrites(storage)
    leaving = Ownership.open(
        refusing,  # type: ignore[arg-type]
        engine_id="engine-a",
        options=OPTIONS,
        clock=clock,
        background="manual",
        warn=WarningSink(),
    )
    ids = [f"wf-{n}" for n in range(3)]
    for wid in ids:
        leaving.workflows.start(wid, JOB)
    refusing.refuse()

    leaving.close()

    record = engine_record(storage, "engine-a")
    assert record is not None, "the record of an engine that left claims behind was deleted"
    assert (record.state, record.held) == ("closed", 3)
    assert not _lock_held(storage, "engine-a")
    assert holders(storage, ids) == dict.fromkeys(ids, ("engine-a", 1))

    driven = Driven()
    with opened_engines(storage, clock, OPTIONS) as make:
        survivor = make("engine-b", handlers={JOB: driven})
        clock.advance(RENEW_MS)  # far from the holders' expiry
        survivor.run_maintenance()
        survivor.run_maintenance()

        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
        assert driven.all_ids() == ids
        assert engine_record(storage, "engine-a") is None  # forgotten once empty


class WatchingCloseOrder:
    """Forwards to a real store; at each claim release and at the record's removal, notes what
    another engine would see then: the record, the lock, and whether a crash probe still runs."""

    def __init__(self, inner: Storage, engine_id: str) -> None:
        self._inner = inner
        self._engine_id = engine_id
        self._lock = threading.Lock()  # guards seen
        self.seen: list[tuple[str, bool, bool, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    def _note(self, what: str) -> None:
        record = engine_record(self._inner, self._engine_id) is not None
        locked = _lock_held(self._inner, self._engine_id)
        probing = any(t.name == "weft-liveness-watch" for t in threading.enumerate())
        with self._lock:
            self.seen.append((what, record, locked, probing))

    def conditional_batch(self, conditions: Sequence[Any], operations: Sequence[Any]) -> bool:
        self._note("cas")
        return bool(self._inner.conditional_batch(conditions, operations))

    def delete(self, key: str) -> None:
        if key == keys.engine_liveness(self._engine_id):
            self._note("record")
        self._inner.delete(key)


def test_close_releases_the_claims_before_the_record_and_the_record_before_the_lock(
    storage: Storage,
) -> None:
    watching = WatchingCloseOrder(storage, "engine-o")
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    ownership = Ownership.open(watching, engine_id="engine-o", options=options)  # type: ignore[arg-type]
    ownership.workflows.start("wf-1", JOB)
    assert ownership.started

    ownership.close()

    # The probe is gone before anything is released; the record and the lock outlive the
    # claims; the lock outlives the record.
    assert watching.seen[-2:] == [("cas", True, True, False), ("record", True, True, False)]
    assert engine_record(storage, "engine-o") is None
    assert not _lock_held(storage, "engine-o")
