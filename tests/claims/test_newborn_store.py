"""A store created by this version is born with its by-engine index marker, so claims written
before its first maintenance pass never cost the full scans of an unindexed store; a store that
already holds claims when it is first stamped is left to the backfill, which checks them."""

from __future__ import annotations

from tests.maintenance.discovery_helpers import ReadCounting
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.claims.engine_index import index_marker_present
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder
from weft_sync.reclaim.discoveries import expiry_judge
from weft_sync.reclaim.engine_discovery import DISCOVERY_WINDOW, EngineIndexDiscovery
from weft_sync.storage import Put, Storage

OPTIONS = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
START = 1_000_000


def test_a_new_store_is_born_with_the_index_marker(storage: Storage) -> None:
    assert not index_marker_present(storage)

    with Ownership.open(storage, options=OPTIONS, background="manual", clock=ManualClock(START)):
        assert index_marker_present(storage)


def test_claims_started_before_the_first_pass_are_found_without_a_full_scan(
    storage: Storage,
) -> None:
    clock = ManualClock(START)
    count = DISCOVERY_WINDOW * 3
    with Ownership.open(storage, options=OPTIONS, background="manual", clock=clock) as cron:
        for n in range(count):  # a burst of starts before any maintenance pass ran
            cron.workflows.start(f"burst-{n:04d}", "job")
        counting = ReadCounting(storage)
        discovery = EngineIndexDiscovery(
            counting,  # type: ignore[arg-type]
            engine_id="judge",
            clock=clock,
            judge=expiry_judge(clock, 1_000),
        )

        discovery.discover(())

        # The windows read a bounded number of holders; the full scan would read all of them.
        assert counting.scanned.get(keys.workflow_owner_holder(""), 0) <= DISCOVERY_WINDOW
        assert index_marker_present(storage)


def test_a_store_that_already_holds_claims_is_left_to_the_backfill(storage: Storage) -> None:
    holder = encode_holder(HolderRecord("engine-old", 1, START + 3_000, START))
    storage.batch(
        [
            Put(keys.workflow_owner_epoch("old-1"), encode_epoch(1)),
            Put(keys.workflow_owner_holder("old-1"), holder),
        ]
    )

    with Ownership.open(storage, options=OPTIONS, background="manual", clock=ManualClock(START)):
        assert not index_marker_present(storage)
