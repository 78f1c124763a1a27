"""``release_all(deadline)``: a renewal in flight past the deadline is not waited for.

Both backends; the renewal is paused inside its compare-and-swap with a gated store, so it is
still in flight when the release runs, whatever the timing.
"""

from __future__ import annotations

import logging
import time

import pytest

from tests.claims.gated import GatedStorage, pause_in_cas
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.codec import decode_holder
from weft_sync.storage import Storage


def test_a_renewal_in_flight_past_the_deadline_leaves_its_claim_to_expire(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    reg.acquire("wf-1")
    reg.acquire("wf-2")
    gate, renewal = pause_in_cas(gated, "wf-1", lambda: reg.renew("wf-1"), "renew")
    with caplog.at_level(logging.WARNING, logger="weft_sync.claims.registry"):
        reg.release_all(deadline=time.monotonic())
    # The other claim was released; the paused one is forgotten here, its holder kept.
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None
    assert reg.list_held_workflow_ids() == []
    [warning] = [r.getMessage() for r in caplog.records if "could not release" in r.getMessage()]
    assert "could not release 1 of 2 claims" in warning
    assert "a renewal in flight outlasted" in warning
    gate.open()
    renewal.result()
    holder = storage.get(keys.workflow_owner_holder("wf-1"))
    assert holder is not None
    record = decode_holder(holder)
    assert record is not None and record.engine_id == reg.engine_id
    assert reg.list_held_workflow_ids() == []
