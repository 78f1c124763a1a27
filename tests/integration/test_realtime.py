"""Claims on the wall clock and the real timer: renewal keeps a claim, silence hands it over.

The one place where real time is the point: TTL 900 ms, renew interval 300 ms, ``system_clock``
and the default :class:`~weft_sync.maintenance.scheduler.TimerScheduler` on both engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.integration.workers import DriveLog
from tests.maintenance.helpers import WAIT_S, PassRecorder
from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.codec import HolderRecord, WorkflowRecord, decode_holder, encode_workflow_record
from weft_sync.maintenance.bootstrap import OwnershipBootstrap, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import PassKind
from weft_sync.storage import Storage

TTL_MS = 900
RENEW_MS = 300
SURVIVAL_TTLS = 3
HANG_GUARD_S = 30.0
"""Fails a takeover that never happens; far above the bound (TTL + 2 renew + one interval)."""
POLL_S = 0.02

pytestmark = pytest.mark.slow


def _holder(storage: Storage, workflow_id: str) -> HolderRecord:
    holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    assert holder is not None
    return holder


def _engine(
    storage: Storage, engine_id: str, drives: DriveLog, passes: PassRecorder
) -> OwnershipBootstrap:
    return bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=system_clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        on_workflow_claim_reclaimed=drives,
        on_pass_complete=passes,
        engine_id=engine_id,
    )


def test_renewed_claim_survives_and_a_silent_one_moves_within_the_bound(
    open_store: Callable[[], Storage],
) -> None:
    a_store, b_store = open_store(), open_store()
    a_drives, b_drives, b_passes = DriveLog(), DriveLog(), PassRecorder()
    a = _engine(a_store, "engine-a", a_drives, PassRecorder())
    b = _engine(b_store, "engine-b", b_drives, b_passes)
    try:
        record = WorkflowRecord("wf-1", "import", "running")
        a_store.put(keys.workflow("wf-1"), encode_workflow_record(record))
        a_store.put(keys.workflow_status_index("running", "wf-1"), b"")
        assert a.registry.acquire("wf-1").epoch == 1
        a.renewal_task.start()
        b.renewal_task.start()

        expiries: list[int] = []
        observe_until = time.monotonic() + SURVIVAL_TTLS * TTL_MS / 1000
        while time.monotonic() < observe_until:
            holder = _holder(b_store, "wf-1")
            assert (holder.engine_id, holder.epoch) == ("engine-a", 1)
            expiries.append(holder.expires_at)
            time.sleep(POLL_S)
        assert expiries == sorted(expiries)
        assert expiries[-1] - expiries[0] >= (SURVIVAL_TTLS - 1) * TTL_MS
        # B kept looking the whole time and never got it.
        b_reclaims = [r.reclaim for r in b_passes.of_kind(PassKind.RECLAIM)]
        assert len(b_reclaims) >= SURVIVAL_TTLS * TTL_MS // RENEW_MS // 2
        assert all(r is not None and r.reclaimed_count == 0 for r in b_reclaims)
        assert b.registry.list_held_workflow_ids() == []

        # A goes silent without releasing (its claim stays in its store).
        assert a.renewal_task.close(timeout=WAIT_S)
        silent_at = time.monotonic()
        last_expiry = _holder(b_store, "wf-1").expires_at
        # A hang guard only: how long the handover takes is measured by
        # bench/takeover_latency.py, not asserted here.
        deadline = silent_at + HANG_GUARD_S
        while _holder(b_store, "wf-1").engine_id != "engine-b":
            assert time.monotonic() < deadline, "engine B never took the claim over"
            time.sleep(POLL_S)
        taken = _holder(b_store, "wf-1")
        assert taken.epoch == 2
        assert taken.claimed_at > last_expiry + 2 * RENEW_MS  # not a moment before expiry
        # The drive follows the takeover CAS; closing B before it would release the claim.
        while not b_drives.calls:
            assert time.monotonic() < deadline, "engine B never drove the reclaimed workflow"
            time.sleep(POLL_S)
        assert b.renewal_task.close(timeout=WAIT_S)
        assert b_drives.calls == ["wf-1"]
        assert a_drives.calls == []
    finally:
        a.renewal_task.close(timeout=WAIT_S)
        b.renewal_task.close(timeout=WAIT_S)
