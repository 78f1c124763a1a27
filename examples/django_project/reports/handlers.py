"""How reclaimed report workflows are resumed; ``settings.WEFT_SYNC_HANDLERS`` names these."""

from __future__ import annotations

from weft_sync.codec import WorkflowRecord
from weft_sync.workflows import Workflows


def resume_report(workflows: Workflows, record: WorkflowRecord) -> None:
    """Render the pages not rendered yet, checkpointing after each one, then complete.

    The checkpoint holds the number of pages done. Each checkpoint is a fenced write: once
    another process has taken the workflow over, it raises ``EngineDeposedError`` and this
    process writes nothing more for it.
    """
    job = record.input if isinstance(record.input, dict) else {}
    pages = int(job.get("pages", 1))
    checkpoint = workflows.load_checkpoint(record.workflow_id)
    done = int(checkpoint) if checkpoint else 0
    for page in range(done + 1, pages + 1):
        workflows.save_checkpoint(record.workflow_id, str(page).encode())
    workflows.complete(record.workflow_id, result={"pages": pages, "resumed_after": done})


def seed_abandoned_report(url: str, workflow_id: str = "report-q3") -> None:
    """Leave a report whose process died an hour ago after 2 of 4 pages (for ``--demo``)."""
    from weft_sync import ManualClock, Ownership, system_clock

    an_hour_ago = ManualClock(system_clock() - 3_600_000)
    with Ownership.open(url, background="manual", clock=an_hour_ago) as dead:
        dead.workflows.start(workflow_id, "report", input={"pages": 4})
        dead.workflows.save_checkpoint(workflow_id, b"2")
        # A killed process releases nothing: the claim stays until it expires.
        dead.registry.forget_local_claim(workflow_id)
