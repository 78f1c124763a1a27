"""EngineLiveness: what start, beat and close leave in the store, and how it handles failures."""

from __future__ import annotations

import logging
import os
import random
import threading

import pytest

from tests.liveness.wrappers import ProbeCounting, WithoutSessionLocks
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.errors import ClosedError, StorageError
from weft_sync.reclaim.engine_liveness import EngineLiveness, heartbeat_due, refresh_after_ms
from weft_sync.reclaim.engine_records import EngineRecord, UndrivenClaims, decode_engine_record
from weft_sync.reclaim.verdicts import EngineVerdict, stale_after_ms, survey_engines
from weft_sync.storage import Storage
from weft_sync.storage.session_locks import storage_session_locks


def _liveness(storage: object, clock: ManualClock, engine_id: str = "engine-a") -> EngineLiveness:
    return EngineLiveness(
        storage,  # type: ignore[arg-type]
        engine_id=engine_id,
        clock=clock,
        claim_ttl_ms=3_000,
        renew_interval_ms=1_000,
    )


def _stored(storage: Storage, engine_id: str = "engine-a") -> EngineRecord:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None
    return record


def _held(storage: Storage, name: str) -> bool:
    locks = storage_session_locks(storage)
    assert locks is not None
    return name in locks.held_session_locks([name])


def test_start_takes_the_lock_and_writes_a_live_record(storage: Storage) -> None:
    clock = ManualClock(5_000)
    liveness = _liveness(storage, clock)
    record = liveness.start()
    try:
        assert _stored(storage) == record == liveness.record()
        assert (record.state, record.heartbeat_at, record.started_at) == ("live", 5_000, 5_000)
        assert (record.claim_ttl_ms, record.renew_interval_ms, record.held) == (3_000, 1_000, 0)
        assert record.lock == "engine-a" and record.pid == os.getpid()
        assert _held(storage, "engine-a")
        with pytest.raises(RuntimeError, match="already started"):
            liveness.start()
    finally:
        liveness.close()


def test_beat_rewrites_heartbeat_and_held_only(storage: Storage) -> None:
    clock = ManualClock(5_000)
    liveness = _liveness(storage, clock)
    first = liveness.start()
    clock.advance(1_000)
    assert liveness.beat(7) is True
    beaten = _stored(storage)
    liveness.close(0)
    assert beaten == liveness.record()
    assert beaten.heartbeat_at == 6_000 and beaten.held == 7
    assert beaten.started_at == first.started_at and beaten.lock == first.lock


def test_a_beat_with_nothing_new_skips_the_put_until_the_refresh_age(storage: Storage) -> None:
    wrapper = ProbeCounting(storage)
    clock = ManualClock(5_000)
    liveness = _liveness(wrapper, clock)  # TTL 3,000 ms, renew interval 1,000 ms
    first = liveness.start()
    assert refresh_after_ms(first) == 1_000
    try:
        puts = wrapper.puts
        clock.advance(999)
        assert liveness.beat(0) is True  # the stored record is current
        assert (wrapper.puts, _stored(storage).heartbeat_at) == (puts, 5_000)
        assert liveness.beat(2) is True  # a new claim count is written at once
        assert (wrapper.puts, _stored(storage).held) == (puts + 1, 2)
        assert _stored(storage).heartbeat_at == 5_999
        clock.advance(999)
        assert liveness.beat(2) is True
        assert wrapper.puts == puts + 1
        clock.advance(1)
        assert liveness.beat(2) is True  # 1,000 ms since the last write: due
        assert (wrapper.puts, _stored(storage).heartbeat_at) == (puts + 2, 6_999)
    finally:
        liveness.close()


def test_undriven_claims_are_written_at_once_and_cost_nothing_while_there_are_none(
    storage: Storage,
) -> None:
    wrapper = ProbeCounting(storage)
    clock = ManualClock(5_000)
    liveness = _liveness(wrapper, clock)  # refresh age 1,000 ms
    liveness.start()
    key = keys.engine_liveness("engine-a")
    awaiting = UndrivenClaims(("job-1",), (), 1)
    try:
        assert liveness.beat(2) is True
        puts, plain = wrapper.puts, storage.get(key)
        clock.advance(10)
        assert liveness.beat(2, None) is True  # nothing new: no put, the same bytes
        assert (wrapper.puts, storage.get(key)) == (puts, plain)
        assert liveness.beat(2, awaiting) is True  # a claim awaiting its driver: written now
        assert (wrapper.puts, _stored(storage).undriven) == (puts + 1, awaiting)
        clock.advance(10)
        assert liveness.beat(2, UndrivenClaims(("job-1",), (), 1)) is True
        assert wrapper.puts == puts + 1  # the same report again is not due
        clock.advance(10)
        assert liveness.beat(2, None) is True  # driven now: written at once, without the key
        assert wrapper.puts == puts + 2
        assert _stored(storage).undriven is None
        assert b"undriven" not in (storage.get(key) or b"")
        assert liveness.beat(1, UndrivenClaims((), ("job-1",), 1)) is True
    finally:
        liveness.close(remaining_claims=1)
    # What a closed engine left behind has no driver: the closed record carries no list.
    assert (_stored(storage).state, _stored(storage).undriven) == ("closed", None)


def _record(heartbeat_at: int, **changes: object) -> EngineRecord:
    fields: dict[str, object] = {
        "engine_id": "e",
        "state": "live",
        "heartbeat_at": heartbeat_at,
        "claim_ttl_ms": 30_000,
        "renew_interval_ms": 5_000,
        "held": 1,
        "lock": "e",
        "pid": 1,
        "host": "h",
        "started_at": 0,
    }
    fields.update(changes)
    return EngineRecord(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("record", "due"),
    [
        (_record(10_000), False),
        (_record(29_999), False),  # the defaults: rewritten once 20 s old
        (_record(30_000), True),
        (_record(9_999), True),  # the clock went back
        (_record(10_001, held=2), True),
        (_record(10_001, lock=None), True),
        (_record(10_001, undriven=UndrivenClaims(("job-1",), (), 1)), True),
    ],
)
def test_a_heartbeat_is_due_when_anything_else_changed_or_it_reached_its_refresh_age(
    record: EngineRecord, due: bool
) -> None:
    assert heartbeat_due(_record(10_000), record) is due


@pytest.mark.parametrize(
    ("ttl", "interval", "refresh"),
    [(30_000, 5_000, 20_000), (3_000, 1_000, 1_000), (10_000, 1_000, 8_000), (1_000, 1_000, 500)],
)
def test_the_refresh_age_is_the_ttl_less_two_intervals_and_at_least_half_of_one(
    ttl: int, interval: int, refresh: int
) -> None:
    assert refresh_after_ms(_record(0, claim_ttl_ms=ttl, renew_interval_ms=interval)) == refresh


@pytest.mark.parametrize("pattern", ["every-interval", "just-short-then-full", "random"])
def test_an_engine_beating_once_per_interval_is_never_stale_at_the_worst_instant(
    storage: Storage, pattern: str
) -> None:
    """The stale rule's margin with skipped beats: the arithmetic of ``heartbeat_due``."""
    interval = 1_000
    clock = ManualClock(1_000_000)
    liveness = _liveness(storage, clock)
    refresh = refresh_after_ms(liveness.start())
    rng = random.Random(7)

    def gap(n: int) -> int:
        if pattern == "every-interval":
            return interval
        if pattern == "random":
            return rng.randint(1, interval)
        # Passes land just short of the refresh age, then a whole interval later.
        return refresh - 1 if n % 2 == 0 else interval

    oldest = 0
    try:
        for n in range(200):
            # The worst instant: just before the next pass, which comes at most an interval on.
            clock.advance(gap(n) - 1)
            stored = _stored(storage)
            age = clock() - stored.heartbeat_at
            oldest = max(oldest, age)
            assert age < refresh + interval
            # Judged by the heartbeat alone, as on a store without session locks.
            [status] = survey_engines(WithoutSessionLocks(storage), now=clock())  # type: ignore[arg-type]
            assert status.verdict is EngineVerdict.LIVE
            clock.advance(1)
            assert liveness.beat(0) is True
    finally:
        liveness.close()
    # A judge's clock must run more than the takeover grace (2 intervals) ahead to call it stale.
    assert stale_after_ms(stored) - oldest > 2 * interval
    if pattern == "just-short-then-full":
        assert oldest == refresh + interval - 2  # the bound is reached, not just met


def test_close_without_claims_deletes_the_record_and_releases_the_lock(storage: Storage) -> None:
    liveness = _liveness(storage, ManualClock(1))
    liveness.start()
    liveness.close(0)
    assert storage.get(keys.engine_liveness("engine-a")) is None
    assert not _held(storage, "engine-a")
    liveness.close(0)  # idempotent
    assert liveness.beat(1) is False


def test_close_with_claims_left_marks_the_record_closed(storage: Storage) -> None:
    clock = ManualClock(1_000)
    liveness = _liveness(storage, clock)
    liveness.start()
    clock.advance(10)
    liveness.close(remaining_claims=4)
    stored = _stored(storage)
    assert (stored.state, stored.held, stored.heartbeat_at) == ("closed", 4, 1_010)
    assert not _held(storage, "engine-a")
    [status] = survey_engines(storage, now=clock())
    assert status.verdict is EngineVerdict.CLOSED


def test_a_store_without_session_locks_runs_ttl_only(storage: Storage) -> None:
    liveness = _liveness(WithoutSessionLocks(storage), ManualClock(1))
    record = liveness.start()
    assert record.lock is None and liveness.session_lock is None
    assert not _held(storage, "engine-a")
    liveness.close()


def test_a_lock_held_elsewhere_is_a_warning_and_ttl_only(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    taken = locks.acquire_session_lock("engine-a")
    try:
        liveness = _liveness(storage, ManualClock(1))
        with caplog.at_level(logging.WARNING, logger="weft_sync.reclaim.engine_liveness"):
            record = liveness.start()
        assert record.lock is None
        assert "runs without a session lock" in caplog.text
        liveness.close()
        assert _held(storage, "engine-a")  # the other holder's lock is untouched
    finally:
        taken.release()


def test_failed_beats_warn_once_per_outage_and_each_next_pass_retries(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    wrapper = ProbeCounting(storage)
    clock = ManualClock(1_000)
    liveness = _liveness(wrapper, clock)
    liveness.start()
    try:
        wrapper.fail_puts = True
        with caplog.at_level(logging.DEBUG, logger="weft_sync.reclaim.engine_liveness"):
            for _ in range(3):
                clock.advance(500)
                assert liveness.beat(3) is False
            assert _stored(storage).heartbeat_at == 1_000
            wrapper.fail_puts = False
            assert liveness.beat(3) is True
        assert _stored(storage).heartbeat_at == 2_500
        failures = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
        # One warning for the outage, not one per pass; the rest at debug, counted.
        assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "3 in a row" in failures[-1].getMessage()
        recovered = [r for r in caplog.records if "written again" in r.getMessage()]
        assert [(r.levelno, r.getMessage().split(" after ")[1]) for r in recovered] == [
            (logging.INFO, "3 failed attempts")
        ]
    finally:
        liveness.close()


def test_a_failed_start_releases_the_lock_and_raises(storage: Storage) -> None:
    wrapper = ProbeCounting(storage)
    wrapper.fail_puts = True
    liveness = _liveness(wrapper, ManualClock(1))
    with pytest.raises(StorageError, match="injected"):
        liveness.start()
    assert not _held(storage, "engine-a")
    liveness.close()


def test_a_close_that_cannot_write_still_releases_the_lock(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    wrapper = ProbeCounting(storage)
    liveness = _liveness(wrapper, ManualClock(1))
    liveness.start()
    wrapper.fail_puts = True
    with caplog.at_level(logging.WARNING, logger="weft_sync.reclaim.engine_liveness"):
        liveness.close(remaining_claims=2)
    assert "could not update its liveness record" in caplog.text
    assert not _held(storage, "engine-a")
    # The record still says live and its lock is gone. On SQLite the release removed the lock
    # file; on PostgreSQL both lock sessions ended, but the engine's store is still connected.
    # Nothing proves a crash either way: its claims go by their expiry.
    [status] = survey_engines(storage, now=1)
    assert status.verdict is EngineVerdict.UNKNOWN


def test_close_waits_for_a_heartbeat_in_flight(storage: Storage) -> None:
    wrapper = ProbeCounting(storage)
    liveness = _liveness(wrapper, ManualClock(1))
    liveness.start()
    wrapper.hold_puts = True
    beat_result: list[bool] = []
    beat = threading.Thread(target=lambda: beat_result.append(liveness.beat(5)))
    beat.start()
    assert wrapper.put_waiting.wait(30)
    closer = threading.Thread(target=liveness.close, args=(0,))
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for the heartbeat being written
    wrapper.hold_puts = False
    wrapper.release_puts.set()
    beat.join(30)
    closer.join(30)
    assert beat_result == [True]
    # The heartbeat landed first and close() deleted the record after it: nothing resurrected.
    assert storage.get(keys.engine_liveness("engine-a")) is None
    assert not _held(storage, "engine-a")


def test_beat_after_a_lost_lock_retakes_it(storage: Storage) -> None:
    liveness = _liveness(storage, ManualClock(1))
    liveness.start()
    lock = liveness.session_lock
    assert lock is not None
    before = lock.identity
    assert _stored(storage).lock_id == before
    try:
        if storage_session_locks(storage) is not None and lock.token.startswith("flock:"):
            path = lock.token.removeprefix("flock:")
            os.unlink(path)
        else:
            backend_pid = int(lock.identity.split(":")[0])  # the lock session's backend
            with storage._connection("test") as conn:  # type: ignore[attr-defined]
                conn.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
        assert liveness.beat(0) is True
        assert _stored(storage).lock == "engine-a"
        assert _held(storage, "engine-a")
        # Another lock object: its identity is published, so probes find it held.
        assert lock.identity != before
        assert _stored(storage).lock_id == lock.identity
    finally:
        liveness.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"engine_id": "e" * 1025}, "1 to 1024 characters"),
        ({"claim_ttl_ms": 0}, "claim_ttl_ms"),
        ({"renew_interval_ms": True}, "renew_interval_ms"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    storage: Storage, kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {
        "engine_id": "e",
        "clock": ManualClock(1),
        "claim_ttl_ms": 3_000,
        "renew_interval_ms": 1_000,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        EngineLiveness(storage, **args)  # type: ignore[arg-type]


def test_the_longest_engine_id_gets_its_lock(storage: Storage) -> None:
    engine_id = "é" * 1024
    liveness = _liveness(storage, ManualClock(1), engine_id=engine_id)
    try:
        assert liveness.start().lock == engine_id
        assert _held(storage, engine_id)
        assert _stored(storage, engine_id).engine_id == engine_id
    finally:
        liveness.close()


def test_an_id_no_lock_can_be_named_by_runs_without_one(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    liveness = _liveness(storage, ManualClock(1), engine_id="a\x00b")
    with caplog.at_level(logging.WARNING, logger="weft_sync.reclaim.engine_liveness"):
        assert liveness.start().lock is None
    assert "NUL" in caplog.text
    liveness.close()


def test_beat_and_close_refuse_bad_counts(storage: Storage) -> None:
    liveness = _liveness(storage, ManualClock(1))
    with pytest.raises(RuntimeError, match="not started"):
        liveness.beat(0)
    liveness.start()
    try:
        with pytest.raises(ValueError, match="held"):
            liveness.beat(-1)
        with pytest.raises(ValueError, match="remaining_claims"):
            liveness.close(-1)
    finally:
        liveness.close()


def test_a_forked_child_cannot_use_it_and_leaves_the_parents_lock(storage: Storage) -> None:
    liveness = _liveness(storage, ManualClock(1))
    liveness.start()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                liveness.beat(1)
                code = 1
            except ClosedError:
                pass
            liveness.close(0)
            os.write(write, b"ok" if code == 0 else b"no")
            os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.read(read, 2) == b"ok"
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _stored(storage) == liveness.record()
        assert _held(storage, "engine-a")
        assert liveness.beat(1) is True
    finally:
        liveness.close()
