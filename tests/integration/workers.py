"""Helpers of the integration tests, including the entry points of their child processes.

Child entry points are module-level functions, so a freshly spawned interpreter (``spawn`` start
method) can import them by name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Event

from weft_sync.clock import system_clock
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.storage import open_storage

OWNER_ENGINE_ID = "owner-process"


class DriveLog:
    """An ``on_workflow_claim_reclaimed`` callback recording the ids it was asked to drive."""

    def __init__(self) -> None:
        # _lock guards calls.
        self._lock = threading.Lock()
        self.calls: list[str] = []

    def __call__(self, workflow_id: str) -> None:
        with self._lock:
            self.calls.append(workflow_id)


def hold_claims_until_killed(
    storage_url: str,
    workflow_ids: Sequence[str],
    claim_ttl_ms: int,
    claim_renew_interval_ms: int,
    ready: Event,
) -> None:
    """Bootstrap, acquire every id, start interval renewal, set ``ready``, then idle forever.

    Renewal starts after the acquires: started earlier, this engine's own reclaim pass would
    claim the running workflows the loop has not reached yet. No other engine runs before
    ``ready``, so a claim that aged while the others were acquired is still this engine's to
    renew. The test ends this process with SIGKILL: nothing is released.

    :raises RuntimeError: an id could not be acquired (``ready`` is never set then).
    """
    storage = open_storage(storage_url)
    ownership = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=system_clock,
        claim_ttl_ms=claim_ttl_ms,
        claim_renew_interval_ms=claim_renew_interval_ms,
        engine_id=OWNER_ENGINE_ID,
    )
    for workflow_id in workflow_ids:
        result = ownership.registry.acquire(workflow_id)
        if result.status != "acquired":
            raise RuntimeError(f"the owner could not acquire {workflow_id!r}: {result}")
    ownership.renewal_task.start()
    ready.set()
    while True:
        time.sleep(60)
