"""Claim time on the store's clock: sampling, error bounds, defaults, and skew immunity.

The sampling tests drive a ``StoreClock`` with a ``ManualClock`` and a server-clock callable
that moves it (a round trip takes time on the engine's clock). The skew tests run three engines
on one real PostgreSQL table with host clocks 20 s apart, ``ManualClock``-driven, no sleeping.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.claims.gated import RENEW_MS, TTL_MS
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.claims.store_clock import StoreClock, TimeSource, resolve_store_clock
from weft_sync.clock import ManualClock, system_clock
from weft_sync.codec import decode_holder
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage, open_storage
from weft_sync.storage.postgres.store import PostgresStorage

SKEW_MS = 20_000
GRACE_MS = 2 * RENEW_MS


@pytest.fixture
def postgres_storage(postgres_base_url: str) -> Iterator[PostgresStorage]:
    """A fresh table on the test PostgreSQL server (these tests are about its clock)."""
    table = "t_" + uuid.uuid4().hex[:16]
    sep = "&" if "?" in postgres_base_url else "?"
    store = open_storage(f"{postgres_base_url}{sep}table={table}")
    assert isinstance(store, PostgresStorage)
    try:
        yield store
    finally:
        store.close()


def _server(
    clock: ManualClock, server_at: Callable[[], int], round_trip_ms: int
) -> Callable[[], int]:
    """A server clock read that takes ``round_trip_ms`` on ``clock``, answered mid-way."""

    def read() -> int:
        clock.advance(round_trip_ms // 2)
        value = server_at()
        clock.advance(round_trip_ms - round_trip_ms // 2)
        return value

    return read


# -- sampling and bounds ---------------------------------------------------------------------


def test_a_sample_keeps_the_offset_to_the_midpoint_and_half_the_round_trip_as_error() -> None:
    local = ManualClock(1_000)
    store = StoreClock(_server(local, lambda: 900_000, 10), local)
    # Three samples of 10 ms each (a tie keeps the first): its midpoint is 1_005.
    assert store.offset_ms == 900_000 - 1_005
    assert store.error_ms == 5 + 1  # ceil(10 / 2) + 1 ms of server rounding
    assert store.now() == local() + store.offset_ms
    assert store.upper() == store.now() + store.error_ms
    assert store.lower() == store.now() - store.error_ms


def test_the_shortest_round_trip_of_a_sample_wins() -> None:
    local = ManualClock(0)
    trips = iter([40, 4, 30])

    def read() -> int:
        trip = next(trips)
        local.advance(trip)
        return 7_000

    store = StoreClock(read, local)
    assert store.error_ms == 2 + 1  # from the 4 ms round trip


def test_the_store_clock_never_runs_backwards_across_samples() -> None:
    local = ManualClock(0)
    server = {"at": 50_000}
    store = StoreClock(lambda: server["at"], local, resample_interval_s=1e-9)
    local.advance(1_000)
    before = store.now()
    assert before == 51_000
    server["at"] = 45_000  # a new sample that would move the clock 6 s back
    assert store.refresh()
    assert store.now() == before
    local.advance(7_000)
    assert store.now() == 52_000


def test_refresh_samples_only_once_its_interval_passed() -> None:
    local = ManualClock(0)
    calls: list[int] = []

    def read() -> int:
        calls.append(1)
        return 10_000

    lazy = StoreClock(read, local, resample_interval_s=3600)
    assert len(calls) == 3
    assert not lazy.refresh() and len(calls) == 3
    eager = StoreClock(read, local, resample_interval_s=1e-9)
    assert eager.refresh() and len(calls) == 9


def test_a_failing_resample_keeps_the_previous_offset() -> None:
    local = ManualClock(0)
    server = {"fail": False}

    def read() -> int:
        if server["fail"]:
            raise OSError("server unreachable")
        return 10_000

    store = StoreClock(read, local, resample_interval_s=1e-9)
    server["fail"] = True
    local.advance(500)
    assert not store.refresh()
    assert store.offset_ms == 10_000 and store.now() == 10_500


def test_claims_are_written_at_the_upper_bound_and_judged_at_the_lower(
    storage: Storage,
) -> None:
    local = ManualClock(0)
    # 100 ms round trips: every reading is uncertain by 51 ms either way.
    a_clock = StoreClock(_server(local, lambda: 1_000_000 + local(), 100), local)
    b_clock = StoreClock(_server(local, lambda: 1_000_000 + local(), 100), local)

    def registry(engine_id: str, clock: StoreClock) -> ClaimRegistry:
        return ClaimRegistry(
            storage,
            engine_id=engine_id,
            clock=clock.upper,
            judge_clock=clock.lower,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
        )

    a, b = registry("engine-a", a_clock), registry("engine-b", b_clock)
    assert a.acquire("wf-1").status == "acquired"
    holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-1")))
    assert holder is not None
    assert holder.expires_at == a_clock.now() + a_clock.error_ms + TTL_MS
    # B takes over only once its lowest possible reading is past the expiry and the grace.
    local.set(local() + (holder.expires_at + GRACE_MS - b_clock.lower()))
    assert b.takeover("wf-1").status == "not-expired"
    local.advance(1)
    assert b.takeover("wf-1").status == "acquired"


# -- choosing the time source ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["db", "STORE", "", 1])
def test_an_unknown_time_source_is_a_value_error_naming_it_and_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match=r"time_source=.*'local', 'store'"):
        OwnershipOptions(time_source=value)  # type: ignore[arg-type]


def test_sqlite_keeps_the_host_clock_and_refuses_the_store_time_source(tmp_path: Path) -> None:
    store = open_storage(f"sqlite:///{tmp_path / 't.db'}")
    try:
        assert resolve_store_clock(store, None, system_clock) is None
        assert resolve_store_clock(store, "local", system_clock) is None
        with pytest.raises(ValueError, match="time_source='store' needs"):
            resolve_store_clock(store, "store", system_clock)
    finally:
        store.close()


def test_postgres_defaults_to_the_store_clock_unless_the_host_injects_its_own(
    postgres_storage: PostgresStorage,
) -> None:
    server = postgres_storage.server_time_ms()
    assert abs(server - system_clock()) < 5_000  # same host
    assert isinstance(resolve_store_clock(postgres_storage, None, system_clock), StoreClock)
    assert resolve_store_clock(postgres_storage, "local", system_clock) is None
    manual = ManualClock(0)
    assert resolve_store_clock(postgres_storage, None, manual) is None
    explicit = resolve_store_clock(postgres_storage, "store", manual)
    assert explicit is not None and abs(explicit.now() - server) < 5_000


# -- skew across engines on one PostgreSQL table -----------------------------------------------


def _skewed(base: ManualClock, skew_ms: int) -> Callable[[], int]:
    return lambda: base() + skew_ms


def _run_skewed_engines(storage: Storage, time_source: TimeSource, rounds: int) -> tuple[int, int]:
    """Three engines (clock skew 0, +20 s, -20 s) holding 4 workflows each; ``rounds`` passes.

    :returns: (takeovers made, claims still held by the engine that started them).
    """
    base = ManualClock(1_700_000_000_000)
    options = OwnershipOptions(
        claim_ttl=TTL_MS // 10, claim_renew_interval=RENEW_MS // 10, time_source=time_source
    )
    engines = [
        Ownership.open(
            storage,
            options=options,
            clock=_skewed(base, skew),
            background="manual",
            on_reclaimed=lambda wid: None,
            warn=lambda warning: None,
        )
        for skew in (0, SKEW_MS, -SKEW_MS)
    ]
    try:
        started = {}
        for n, engine in enumerate(engines):
            for i in range(4):
                wid = f"{time_source}-e{n}-w{i}"
                engine.workflows.start(wid, "job")
                engine.drivers.enter(wid, 1, "the test's thread")  # driven all along
                started[wid] = engine.engine_id
        for _ in range(rounds):
            base.advance(options.claim_renew_interval_ms)
            for engine in engines:
                engine.run_maintenance()
        takeovers = sum(e.metrics.snapshot().attempts["takeover"] for e in engines)
        kept = 0
        for wid, engine_id in started.items():
            holder = decode_holder(storage.get(keys.workflow_owner_holder(wid)))
            kept += holder is not None and holder.engine_id == engine_id
        return takeovers, kept
    finally:
        for engine in engines:
            engine.close()


def test_store_time_makes_twenty_seconds_of_host_skew_take_over_no_live_claim(
    postgres_storage: PostgresStorage,
) -> None:
    takeovers, kept = _run_skewed_engines(postgres_storage, "store", rounds=40)
    assert (takeovers, kept) == (0, 12)


def test_local_time_with_the_same_skew_takes_over_live_claims(
    postgres_storage: PostgresStorage,
) -> None:
    takeovers, kept = _run_skewed_engines(postgres_storage, "local", rounds=40)
    assert takeovers > 0 and kept < 12
