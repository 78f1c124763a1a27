"""``claims`` and ``show`` print each live claim's driver state as its holder's engine published it.

Engines run maintenance by hand on a ``ManualClock`` an hour ahead of the wall clock (the CLI
judges expiry on the wall clock, so their claims read live), on both backends; moving the clock
past one renew interval is what "no driver past the grace" means. The rules that need records no
running engine writes (closed, stale, cut short) are checked on :func:`driver_state` itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from tests.claims.gated import BatchMatcher, GatedStorage
from tests.cli.helpers import HOUR_MS, leave_claim, run_cli
from tests.engines import MakeOwnership, handler_running, opened_engines
from weft_sync import keys, system_clock
from weft_sync.cli.commands.listing import driver_state
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord
from weft_sync.errors import StorageError
from weft_sync.options import OwnershipOptions
from weft_sync.reclaim.engine_records import (
    MAX_UNDRIVEN_IDS,
    EngineRecord,
    UndrivenClaims,
    decode_engine_record,
)
from weft_sync.storage import Delete, Storage
from weft_sync.storage.base import Batch

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(
    claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, handler_stuck_after="10s"
)
WAIT_S = 10.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(system_clock() + HOUR_MS)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


def _json_drivers(url: str) -> dict[str, str | None]:
    code, out = run_cli("--url", url, "claims", "--json")
    assert code == 0
    return {row["workflow_id"]: row["driver"] for row in json.loads(out)}


def _table_drivers(url: str) -> dict[str, str]:
    code, out = run_cli("--url", url, "claims")
    assert code == 0
    header, *rows = out.splitlines()
    start, end = header.index("DRIVER"), header.index("EXPIRES")
    return {row.split()[0]: row[start:end].strip() for row in rows}


def _shown_driver(url: str, workflow_id: str) -> str:
    code, out = run_cli("--url", url, "show", workflow_id)
    assert code == 0
    return dict(line.split(None, 1) for line in out.splitlines())["driver"]


def _published(storage: Storage, engine_id: str) -> UndrivenClaims | None:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None
    return record.undriven


# -- as engines publish it -------------------------------------------------------------------


def test_a_claim_inside_a_drive_block_shows_driven(
    make_ownership: MakeOwnership, storage: Storage, storage_url: str
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    with engine.workflows.drive("job-1") as ctx:
        engine.run_maintenance()
        assert _json_drivers(storage_url) == {"job-1": "driven"}
        assert _table_drivers(storage_url) == {"job-1": "driven"}
        assert _shown_driver(storage_url, "job-1") == "driven"
        assert _published(storage, "engine-a") is None
        ctx.complete()


def test_a_claim_whose_handler_runs_shows_driven(
    make_ownership: MakeOwnership, storage_url: str, clock: ManualClock
) -> None:
    with handler_running(
        make_ownership, clock, past_grace_ms=PAST_GRACE_MS, wait_s=WAIT_S
    ) as survivor:
        clock.advance(RENEW_MS + 1)  # past the grace: the handler is its driver
        survivor.run_maintenance(wait_handlers=0)
        assert _json_drivers(storage_url) == {"job-1": "driven"}
        assert _shown_driver(storage_url, "job-1") == "driven"
    assert _json_drivers(storage_url) == {}


def test_a_started_claim_nobody_drives_shows_awaiting_then_is_released_after_the_grace(
    make_ownership: MakeOwnership, storage: Storage, storage_url: str, clock: ManualClock
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    engine.workflows.start("job-2", "job")
    with engine.workflows.drive("job-2") as ctx:
        engine.run_maintenance()
        assert _json_drivers(storage_url) == {"job-1": "awaiting", "job-2": "driven"}
        assert _table_drivers(storage_url) == {"job-1": "awaiting driver", "job-2": "driven"}
        assert _shown_driver(storage_url, "job-1") == "awaiting driver"
        assert _published(storage, "engine-a") == UndrivenClaims(("job-1",), (), 1)

        clock.advance(RENEW_MS + 1)
        engine.run_maintenance()  # its heartbeat says "no driver", then the check releases it
        assert _published(storage, "engine-a") == UndrivenClaims((), ("job-1",), 1)
        assert _json_drivers(storage_url) == {"job-2": "driven"}
        engine.run_maintenance()
        assert _published(storage, "engine-a") is None
        ctx.complete()


def _releases(workflow_id: str) -> BatchMatcher:
    holder = keys.workflow_owner_holder(workflow_id)

    def match(batches: Sequence[Batch]) -> bool:
        return any(isinstance(op, Delete) and op.key == holder for _, ops in batches for op in ops)

    return match


def test_an_undriven_claim_whose_release_failed_shows_no_driver_until_its_holder_expires(
    storage: Storage, storage_url: str, clock: ManualClock
) -> None:
    gated = GatedStorage(storage)
    with opened_engines(gated, clock, OPTIONS) as make:
        engine = make("engine-a")
        engine.workflows.start("job-1", "job")
        engine.run_maintenance()
        clock.advance(RENEW_MS + 1)
        failed = gated.raise_on_next_cas(
            StorageError("injected: the store is locked"),
            match=_releases("job-1"),
        )
        engine.run_maintenance()
        assert failed.reached.is_set()
        engine.run_maintenance()

        # Forgotten locally, not renewed: its holder stays in the store until it expires.
        assert engine.registry.current_epoch("job-1") is None
        assert _json_drivers(storage_url) == {"job-1": "no-driver"}
        assert _table_drivers(storage_url) == {"job-1": "no driver"}
        assert _shown_driver(storage_url, "job-1") == "no driver"
        assert _published(storage, "engine-a") == UndrivenClaims((), ("job-1",), 1)

        clock.advance(TTL_MS + 1)
        engine.run_maintenance()
        assert _published(storage, "engine-a") is None


def test_a_claim_taken_after_its_engines_last_heartbeat_shows_unknown(
    make_ownership: MakeOwnership, storage_url: str, clock: ManualClock
) -> None:
    engine = make_ownership("engine-a")
    engine.run_maintenance()
    clock.advance(10)
    engine.workflows.start("job-1", "job")
    assert _json_drivers(storage_url) == {"job-1": "unknown"}
    engine.run_maintenance()
    assert _json_drivers(storage_url) == {"job-1": "awaiting"}


def test_a_claim_whose_engine_left_no_record_shows_unknown(storage_url: str) -> None:
    leave_claim(storage_url, "job-1", offset_ms=HOUR_MS, engine_id="crashed-engine")
    assert _json_drivers(storage_url) == {"job-1": "unknown"}
    assert _shown_driver(storage_url, "job-1") == "unknown"


# -- the rules, on records no running engine writes ------------------------------------------

NOW = 1_000_000
HOLDER = HolderRecord("engine-a", epoch=3, expires_at=NOW + 20_000, claimed_at=NOW - 10_000)
RECORD = EngineRecord(
    engine_id="engine-a",
    state="live",
    heartbeat_at=NOW - 1_000,
    claim_ttl_ms=30_000,
    renew_interval_ms=5_000,
    held=1,
    lock=None,
    pid=1,
    host="h",
    started_at=NOW - 60_000,
)
FULL = UndrivenClaims.of([f"other-{i:02}" for i in range(MAX_UNDRIVEN_IDS)], ["job-9"])


@pytest.mark.parametrize(
    ("engine", "state"),
    [
        (RECORD, "driven"),  # an older engine publishes nothing: it reads as driven
        (replace(RECORD, undriven=UndrivenClaims(("job-1",), (), 1)), "awaiting"),
        (replace(RECORD, undriven=UndrivenClaims((), ("job-1",), 1)), "no-driver"),
        (replace(RECORD, undriven=UndrivenClaims(("job-2",), (), 1)), "driven"),
        (replace(RECORD, undriven=FULL), "unknown"),  # cut short without naming it
        (replace(RECORD, state="closed"), "no-driver"),
        (None, "unknown"),
        (replace(RECORD, engine_id="engine-b"), "unknown"),
        (replace(RECORD, heartbeat_at=HOLDER.claimed_at - 1), "unknown"),
        (replace(RECORD, started_at=HOLDER.claimed_at + 1), "unknown"),  # a previous engine's
    ],
)
def test_driver_state_goes_by_what_the_holders_engine_last_published(
    engine: EngineRecord | None, state: str
) -> None:
    assert driver_state("job-1", HOLDER, engine, NOW) == state


def test_a_stale_heartbeat_says_nothing_about_drivers() -> None:
    # Stale once older than TTL + 2 renew intervals (40 s here) on the reader's clock.
    engine = replace(RECORD, heartbeat_at=NOW - 40_000, started_at=NOW - 90_000)
    holder = replace(HOLDER, claimed_at=NOW - 50_000)
    assert driver_state("job-1", holder, engine, NOW) == "driven"
    assert driver_state("job-1", holder, engine, NOW + 1) == "unknown"


def test_a_claim_named_in_lists_cut_short_still_shows_its_state() -> None:
    assert FULL is not None and not FULL.complete
    assert driver_state("job-9", HOLDER, replace(RECORD, undriven=FULL), NOW) == "no-driver"
