"""Discovery under storage faults: a failing lock probe costs the crash signal, not the backstop.

Session locks are an optional capability layered over the claims' own expiry rule; when the
probe fails, engines are judged by their heartbeats (no ``CRASHED`` verdict) and expired
claims are still taken over.
"""

from __future__ import annotations

import pytest

from tests.engines import opened_engines
from tests.liveness.crashes import dead_lock
from tests.liveness.wrappers import ProbeCounting
from tests.maintenance.discovery_helpers import (
    JOB,
    OPTIONS,
    PAST_EXPIRY_MS,
    RENEW_MS,
    Driven,
    holders,
    index_store,
    rewrite_record,
)
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage


@pytest.mark.parametrize("discovery", ["auto", "scan"])
def test_expired_claims_are_taken_over_while_the_lock_probe_fails(
    storage: Storage, discovery: str
) -> None:
    clock = ManualClock(1_000_000)
    probing = ProbeCounting(storage)
    options = OPTIONS.__class__(
        claim_ttl=OPTIONS.claim_ttl,
        claim_renew_interval=OPTIONS.claim_renew_interval,
        reclaim_discovery=discovery,  # type: ignore[arg-type]
    )
    with opened_engines(probing, clock, options) as make:  # type: ignore[arg-type]
        frozen = make("engine-frozen")
        ids = [f"job-{n}" for n in range(3)]
        for wid in ids:
            frozen.workflows.start(wid, JOB)
        driven = Driven()
        survivor = make("engine-b", handlers={JOB: driven})
        index_store(storage)
        clock.advance(PAST_EXPIRY_MS)
        probing.fail_probes = 1_000

        survivor.run_maintenance()

        assert probing.probes > 0  # the probe was tried, and failed
        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
        assert driven.all_ids() == ids


def test_a_failing_probe_makes_no_engine_crashed(storage: Storage) -> None:
    clock = ManualClock(1_000_000)
    probing = ProbeCounting(storage)
    with opened_engines(probing, clock, OPTIONS) as make:  # type: ignore[arg-type]
        dead = make("engine-dead")
        ids = [f"job-{n}" for n in range(3)]
        for wid in ids:
            dead.workflows.start(wid, JOB)
        survivor = make("engine-b", handlers={JOB: Driven()})
        index_store(storage)
        rewrite_record(
            storage,
            "engine-dead",
            lock="engine-dead-gone",
            lock_id=dead_lock(storage, "engine-dead-gone"),
        )  # would look crashed
        clock.advance(RENEW_MS)
        probing.fail_probes = 1_000

        survivor.run_maintenance()

        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-dead", 1))
