"""A claim owner killed with SIGKILL: a survivor takes over every claim and fences the dead one.

The owner is a separate, spawned interpreter holding 200 claims with interval renewal (TTL 900
ms, renew interval 300 ms); the survivor runs in the test process with its own interval task.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.integration.workers import OWNER_ENGINE_ID, DriveLog, hold_claims_until_killed
from tests.maintenance.helpers import WAIT_S
from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.codec import (
    WorkflowRecord,
    decode_epoch,
    decode_holder,
    encode_epoch,
    encode_workflow_record,
)
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.storage import Condition, Put, Storage

CLAIMS = 200
TTL_MS = 900
RENEW_MS = 300
HANG_GUARD_S = 60.0
"""Fails a takeover that never completes; far above the bound (TTL + 2 renew + one interval)."""
STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.02

pytestmark = pytest.mark.slow


def _holders(storage: Storage) -> dict[str, tuple[str, int, int]]:
    """``{workflow id: (engine id, epoch, expires_at)}`` for every readable holder."""
    found: dict[str, tuple[str, int, int]] = {}
    for key, value in storage.scan(keys.workflow_owner_holder("")):
        holder = decode_holder(value)
        if holder is not None:
            workflow_id = keys.decode_key_component(key[len(keys.workflow_owner_holder("")) :])
            found[workflow_id] = (holder.engine_id, holder.epoch, holder.expires_at)
    return found


def _fenced_writes(storage: Storage, ids: list[str], tokens: dict[str, bytes]) -> list[bool]:
    return storage.conditional_batches(
        [
            (
                [Condition(keys.workflow_owner_epoch(wid), tokens[wid])],
                [Put(keys.workflow(wid), encode_workflow_record(_record(wid, step=2)))],
            )
            for wid in ids
        ]
    )


def _record(workflow_id: str, step: int = 1) -> WorkflowRecord:
    return WorkflowRecord(workflow_id, "import", "running", input={"step": step})


def test_survivor_takes_over_every_claim_of_a_killed_owner_and_fences_it(
    storage_url: str, open_store: Callable[[], Storage]
) -> None:
    store = open_store()
    ids = [f"wf-{n:03d}" for n in range(CLAIMS)]
    for start in range(0, CLAIMS, 50):
        store.batch(
            [
                op
                for wid in ids[start : start + 50]
                for op in (
                    Put(keys.workflow(wid), encode_workflow_record(_record(wid))),
                    Put(keys.workflow_status_index("running", wid), b""),
                )
            ]
        )

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    owner = context.Process(
        target=hold_claims_until_killed,
        args=(storage_url, ids, TTL_MS, RENEW_MS, ready),
        name="weft-claim-owner",
        daemon=True,
    )
    drives = DriveLog()
    survivor = bootstrap_workflow_lease_ownership(
        storage=store,
        clock=system_clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        on_workflow_claim_reclaimed=drives,
        engine_id="survivor",
    )
    owner.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready.wait(0.1):
            assert owner.is_alive(), f"the owner process died first (exit {owner.exitcode})"
            assert time.monotonic() < deadline, "the owner process never became ready"
        survivor.renewal_task.start()
        # Live claims: the survivor's reclaim passes leave them alone for a whole TTL.
        time.sleep(TTL_MS / 1000)
        held = _holders(store)
        assert sorted(held) == ids
        assert {engine for engine, _, _ in held.values()} == {OWNER_ENGINE_ID}
        assert {epoch for _, epoch, _ in held.values()} == {1}
        assert min(expires for _, _, expires in held.values()) > system_clock()
        assert survivor.registry.list_held_workflow_ids() == []

        assert owner.pid is not None
        os.kill(owner.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        owner.join(WAIT_S)
        assert owner.exitcode == -signal.SIGKILL

        # A hang guard only: the takeover time is measured by bench/takeover_latency.py.
        deadline = killed_at + HANG_GUARD_S
        # Wait for the drives, not only the claims: stopping the survivor while a reclaim is
        # between its CAS and its drive would (rightly) release that claim undriven.
        while len(drives.calls) < CLAIMS:
            assert time.monotonic() < deadline, (
                f"the survivor drove {len(drives.calls)} of {CLAIMS} workflows"
            )
            time.sleep(POLL_S)
    finally:
        if owner.is_alive():
            owner.kill()
            owner.join(WAIT_S)
        assert survivor.renewal_task.close(timeout=WAIT_S)

    assert sorted(drives.calls) == ids  # each driven exactly once
    held = _holders(store)
    assert {(engine, epoch) for engine, epoch, _ in held.values()} == {("survivor", 2)}
    assert {decode_epoch(store.get(keys.workflow_owner_epoch(wid))) for wid in ids} == {2}
    assert survivor.metrics.snapshot().attempts["takeover"] == CLAIMS
    # The dead owner's epoch can no longer write (nor its number alone); the survivor's can.
    assert _fenced_writes(store, ids, dict.fromkeys(ids, encode_epoch(1))) == [False] * CLAIMS
    assert _fenced_writes(store, ids, dict.fromkeys(ids, encode_epoch(2))) == [False] * CLAIMS
    tokens = {wid: survivor.registry.current_epoch_bytes(wid) or b"" for wid in ids}
    assert _fenced_writes(store, ids, tokens) == [True] * CLAIMS
