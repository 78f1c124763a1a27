"""A PostgreSQL server restarted under a live engine: renewal rides out the outage.

The engine holds 20 claims (TTL 60 s, renew interval 200 ms, wall clock, real timer) on a private
cluster, which is stopped for about a second and started again. Renewals fail while the server is
down; they are counted, never raised out of the maintenance threads, and succeed again once it is
back, with every claim still held.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.maintenance.helpers import WAIT_S, PassRecorder
from tests.pgcluster import PostgresCluster
from tests.support.waiting import wait_for
from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.codec import HolderRecord, decode_holder
from weft_sync.errors import StorageError
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import PassKind, PassResult, RenewalStatus
from weft_sync.storage import PostgresStorage, Storage

CLAIMS = 20
TTL_MS = 60_000
RENEW_MS = 200
OUTAGE_S = 1.0
POOL_TIMEOUT_S = 0.5
"""How long a call waits for a pooled connection: keeps each call during the outage short."""
RECOVERY_TIMEOUT_S = 15.0
POLL_S = 0.02
ENGINE_ID = "engine-restart"

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _holders(storage: Storage) -> dict[str, HolderRecord]:
    prefix = keys.workflow_owner_holder("")
    found: dict[str, HolderRecord] = {}
    for key, value in storage.scan(prefix):
        holder = decode_holder(value)
        assert holder is not None, f"undecodable holder under {key!r}"
        found[keys.decode_key_component(key[len(prefix) :])] = holder
    return found


def _wait_for_full_renewal(passes: PassRecorder, *, after_ms: int) -> PassResult:
    """The first renewal pass that started after ``after_ms`` and renewed every claim."""

    def full_renewal() -> PassResult | None:
        renewals = passes.of_kind(PassKind.RENEWAL)
        full = (r for r in renewals if r.started_at > after_ms and r.renewed_count == CLAIMS)
        return next(full, None)

    result = wait_for(
        full_renewal,
        lambda found: found is not None,
        "a renewal pass to renew every claim again",
        timeout_s=RECOVERY_TIMEOUT_S,
        poll_s=POLL_S,
    )
    assert result is not None
    return result


def test_renewal_survives_a_server_restart_without_losing_a_claim(
    private_cluster: PostgresCluster, thread_crashes: list[threading.ExceptHookArgs]
) -> None:
    storage = PostgresStorage(private_cluster.url, table="weft_restart", timeout=POOL_TIMEOUT_S)
    warned: list[Warning] = []
    passes = PassRecorder()
    try:
        engine = bootstrap_workflow_lease_ownership(
            storage=storage,
            clock=system_clock,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            on_pass_complete=passes,
            warn=warned.append,
            engine_id=ENGINE_ID,
        )
        ids = [f"wf-{n:02d}" for n in range(CLAIMS)]
        for wid in ids:
            assert engine.registry.acquire(wid).status == "acquired"
        engine.renewal_task.start()
        try:
            _wait_for_full_renewal(passes, after_ms=system_clock())
            before = _holders(storage)

            private_cluster.stop(remove=False)
            time.sleep(OUTAGE_S)
            # The TTL is far longer than any restart, so the claims outlive the outage.
            private_cluster.start()
            restarted_at = system_clock()

            _wait_for_full_renewal(passes, after_ms=restarted_at)
            after = _holders(storage)
        finally:
            closed = engine.renewal_task.close(timeout=WAIT_S)
        assert closed, "maintenance passes were still running after close()"

        # Renewed again after the outage: every expiry moved past the outage.
        assert sorted(after) == ids
        for wid in ids:
            assert (after[wid].engine_id, after[wid].epoch) == (ENGINE_ID, 1)
            assert after[wid].expires_at >= before[wid].expires_at + OUTAGE_S * 1000
            assert after[wid].claimed_at == before[wid].claimed_at
        # Nothing was lost.
        assert sorted(engine.registry.list_held_workflow_ids()) == ids
        assert warned == []
        # The outage's failures were counted and reported, not raised.
        failed = [
            outcome
            for result in passes.of_kind(PassKind.RENEWAL)
            for outcome in result.outcomes
            if outcome.status is RenewalStatus.FAILED
        ]
        assert failed, "no renewal failed while the server was down"
        assert all(isinstance(outcome.error, StorageError) for outcome in failed)
        snapshot = engine.metrics.snapshot()
        assert snapshot.renewal_failures == len(failed)
        assert snapshot.attempts["deposed"] == 0
        assert thread_crashes == []

        engine.registry.release_all()
        assert _holders(storage) == {}
    finally:
        storage.close()
