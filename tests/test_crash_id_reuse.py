"""A crash verdict moves only the crashed engine's claims, never those of an engine restarted
under the same id (a pod or host name) within one TTL of the crash.

The crashed engine is a real process (``tests.liveness.holder``: its session lock and engine
record) that is SIGKILLed; its claims are written under its engine id by a registry in the test
process, as in ``tests/test_bare_claim_crash.py``. The TTLs are far longer than the tests, so a
claim that moves can only have moved on a verdict of death.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.claims.gated import WarningSink
from tests.liveness.procs import WAIT_S, holding
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import Ownership, OwnershipOptions, WorkflowClaimUnavailableError
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import system_clock
from weft_sync.keys import engine_liveness
from weft_sync.reclaim.crash_detection import CrashDetection
from weft_sync.reclaim.discoveries import ScanDiscovery, expiry_judge
from weft_sync.reclaim.engine_liveness import EngineLiveness
from weft_sync.storage import Storage

TTL_MS = 900_000
RENEW_MS = 300_000
# The first maintenance tick comes after one renew interval: far beyond the waits here.
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


@contextmanager
def _registry(storage: Storage, engine_id: str) -> Iterator[ClaimRegistry]:
    registry = ClaimRegistry(
        storage,
        engine_id=engine_id,
        clock=system_clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=WarningSink(),
    )
    try:
        yield registry
    finally:
        registry.close()


@contextmanager
def _liveness(storage: Storage, engine_id: str) -> Iterator[bytes]:
    """An engine's liveness (lock and record) under ``engine_id`` in this process; yields the
    record's bytes."""
    liveness = EngineLiveness(
        storage,
        engine_id=engine_id,
        clock=system_clock,
        claim_ttl_ms=TTL_MS,
        renew_interval_ms=RENEW_MS,
    )
    liveness.start()
    try:
        record = storage.get(engine_liveness(engine_id))
        assert record is not None
        yield record
    finally:
        liveness.close()


def _crashed_record(storage: Storage, storage_url: str, engine_id: str) -> bytes:
    """Run an engine's liveness in a child under ``engine_id``, SIGKILL it, return its record."""
    with holding(storage_url, engine_id, "engine") as child:
        child.proc.kill()
        child.proc.wait()
    record = storage.get(engine_liveness(engine_id))
    assert record is not None
    return record


def test_a_live_engine_reusing_a_crashed_engines_id_keeps_its_claim(
    storage: Storage, storage_url: str
) -> None:
    with (
        holding(storage_url, "engine-a", "engine") as first,
        _registry(storage, "engine-a") as crashed,
        Ownership.open(storage, engine_id="engine-b", options=OPTIONS) as survivor,
    ):
        assert crashed.acquire("w1").status == "acquired"
        first.proc.kill()
        first.proc.wait()
        # The crashed engine's claim moves at once, through the crash probe ...
        with survivor.claim("w1", wait=WAIT_S) as taken:
            assert taken.epoch == 2
        # ... and an engine opened under its id right after keeps the claim it makes.
        with (
            Ownership.open(storage, engine_id="engine-a", options=OPTIONS) as restarted,
            restarted.claim("w2") as held,
        ):
            with pytest.raises(WorkflowClaimUnavailableError) as refused, survivor.claim("w2"):
                pass
            assert refused.value.held_by == "engine-a"
            assert (holder_engine(storage, "w2"), stored_epoch(storage, "w2")) == ("engine-a", 1)
            assert held.epoch == 1
            held.assert_held()


def test_a_verdict_takes_early_only_while_the_judged_record_is_unchanged(
    storage: Storage, storage_url: str
) -> None:
    with _registry(storage, "engine-a") as first, _registry(storage, "engine-b") as survivor:
        record = _crashed_record(storage, storage_url, "engine-a")
        for wid in ("w1", "w2", "w3"):
            assert first.acquire(wid).status == "acquired"
        # Judged on other bytes than the record has: nothing proves the holder is the crash's.
        wrong = survivor.takeover("w1", dead_engines={"engine-a": record + b"?"})
        assert (wrong.status, wrong.held_by) == ("not-expired", "engine-a")
        taken = survivor.takeover("w1", dead_engines={"engine-a": record})
        assert (taken.status, taken.epoch, taken.before_expiry) == ("acquired", 2, True)

        with _liveness(storage, "engine-a"), _registry(storage, "engine-a") as second:
            assert second.acquire("w4").status == "acquired"
            # The verdict predates the new record: neither the new engine's claim nor the
            # crashed engine's own (no holder says which engine of the id wrote it) goes early.
            alone = survivor.takeover("w4", dead_engines={"engine-a": record})
            assert (alone.status, alone.held_by) == ("not-expired", "engine-a")
            many = survivor.takeover_many(["w2", "w4"], dead_engines={"engine-a": record})
            assert [getattr(r, "status", r) for r in many] == ["not-expired", "not-expired"]
            assert [stored_epoch(storage, wid) for wid in ("w2", "w3", "w4")] == [1, 1, 1]
            assert second.current_epoch("w4") == 1


def test_a_reclaim_pass_judged_before_a_restart_takes_nothing_of_it_early(
    storage: Storage, storage_url: str
) -> None:
    with (
        _registry(storage, "engine-a") as first,
        _liveness(storage, "engine-b"),  # a judge trusts the locks while it holds its own
        _registry(storage, "engine-b") as survivor,
    ):
        _crashed_record(storage, storage_url, "engine-a")
        assert first.acquire("w1").status == "acquired"
        discovery = ScanDiscovery(
            storage,
            expiry_judge(system_clock, RENEW_MS),
            skip_live=True,
            engine_id="engine-b",
            clock=system_clock,
        ).discover(())
        assert discovery.dead_engines == {"engine-a"}
        assert discovery.stranded == ["w1"]
        # The engine restarts under its id between the pass's survey and its takeovers.
        with _liveness(storage, "engine-a"), _registry(storage, "engine-a") as second:
            assert second.acquire("w2").status == "acquired"
            results = survivor.takeover_many(["w1", "w2"], dead_engines=discovery.dead_records)
            assert [getattr(r, "status", r) for r in results] == ["not-expired", "not-expired"]
            assert second.current_epoch("w2") == 1


def test_a_death_is_forgotten_once_a_survey_reads_another_record() -> None:
    crash = CrashDetection(None, None, lambda: 0)  # type: ignore[arg-type]
    crash.note_dead("engine-a", b"first")
    crash.note_records({"engine-a": b"first", "engine-c": b"other"})
    assert crash.dead_engines() == {"engine-a": b"first"}
    crash.note_records({"engine-a": b"restarted"})
    assert crash.dead_engines() == {}
    crash.note_dead("engine-a", b"restarted")
    crash.note_records({})  # its record was removed
    assert crash.dead_engines() == {}


def test_a_death_without_its_record_wakes_waiters_and_takes_nothing() -> None:
    crash = CrashDetection(None, None, lambda: 0)  # type: ignore[arg-type]
    seen = crash.death_count()
    crash.note_dead("engine-a")
    assert crash.death_count() == seen + 1
    assert crash.dead_engines() == {}
