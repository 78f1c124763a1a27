"""Checks the gunicorn tests of both web examples make on the store while jobs are driven."""

from __future__ import annotations

import time
from typing import Final

from tests.support.waiting import wait_for
from weft_sync.codec import decode_holder
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

TAKEOVER_WAIT_S: Final = 20.0
"""Hang guard: how long a paused worker's jobs may stay with its engine (far above the TTL)."""
FINISH_WAIT_S: Final = 40.0
"""Hang guard: how long the jobs may stay running before the test calls them stranded."""


def wait_until_taken_over(store: Storage, accepted: dict[str, int], pid: int, engine: str) -> None:
    """Wait until no running job accepted by ``pid`` is still held by its ``engine``."""
    ledger = Workflows(store)
    mine = [job for job, owner in accepted.items() if owner == pid]

    def still_held() -> list[str]:
        held = []
        for job in mine:
            holder = decode_holder(store.get(workflow_owner_holder(job)))
            record = ledger.get(job)
            running = record is not None and record.status == "running"
            if running and (holder is None or holder.engine_id == engine):
                held.append(job)
        return held

    wait_for(
        still_held,
        lambda held: not held,
        "every job of the paused worker to be taken over (last value: those still held)",
        timeout_s=TAKEOVER_WAIT_S,
        poll_s=0.1,
    )


def wait_until_finished(ledger: Workflows, accepted: dict[str, int]) -> list[str]:
    """Wait for every job to leave ``running``; return those that never did (stranded)."""
    deadline = time.monotonic() + FINISH_WAIT_S
    while True:
        records = {job: ledger.get(job) for job in accepted}
        pending = [job for job, r in records.items() if r is not None and r.status == "running"]
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.1)
