"""``weft-sync maintain --handler tests.cli.handler:…`` targets for the CLI tests.

The CLI calls a handler with a :class:`~weft_sync.ReclaimedWorkflow`, as every host does.
:func:`resume` writes a checkpoint through ``ctx.workflows`` (a fenced write as the new owner)
and records the id in :data:`RESUMED` (read by in-process tests), then prints ``resumed <id>``
(read from a subprocess's stdout). :func:`resume_until_closed` then keeps driving until the
engine closes; :func:`finish` also completes the workflow; :func:`explode`
raises; :func:`explode_on_wf_1` raises on ``wf-1`` and finishes every other workflow;
:func:`stall` takes a few seconds.
"""

from __future__ import annotations

import threading
import time

from weft_sync.ownership import ReclaimedWorkflow

__all__ = [
    "CHECKPOINT",
    "NOT_CALLABLE",
    "RESUMED",
    "explode",
    "explode_on_wf_1",
    "finish",
    "resume",
    "resume_until_closed",
    "stall",
    "take_resumed",
]

# _lock guards RESUMED: the CLI calls handlers from maintenance worker threads.
_lock = threading.Lock()
RESUMED: list[tuple[str, str, int]] = []

NOT_CALLABLE = "a handler spec naming this attribute is refused"
CHECKPOINT = b"step 2 of 3, written by the new owner"


def resume(ctx: ReclaimedWorkflow) -> None:
    """Write a checkpoint as the new owner and record ``(id, type, epoch)``."""
    ctx.workflows.save_checkpoint(ctx.workflow_id, CHECKPOINT)
    with _lock:
        RESUMED.append((ctx.workflow_id, ctx.type, ctx.epoch))
    print(f"resumed {ctx.workflow_id}", flush=True)


def resume_until_closed(ctx: ReclaimedWorkflow) -> None:
    """Resume, then keep driving (holding the claim) until the engine closes."""
    resume(ctx)
    while not ctx.ownership.closed:
        time.sleep(0.02)


def finish(ctx: ReclaimedWorkflow) -> None:
    """Resume, then complete the workflow (which releases the claim in the same write)."""
    resume(ctx)
    ctx.workflows.complete(ctx.workflow_id, result={"resumed_at_epoch": ctx.epoch})


def explode(ctx: ReclaimedWorkflow) -> None:
    """A handler that fails on every workflow."""
    raise RuntimeError(f"cannot drive {ctx.workflow_id} at postgresql://app:s3cret@db/main")


def explode_on_wf_1(ctx: ReclaimedWorkflow) -> None:
    """Raise (as :func:`explode`) on ``wf-1``; :func:`finish` every other workflow."""
    if ctx.workflow_id == "wf-1":
        explode(ctx)
    finish(ctx)


def take_resumed() -> list[tuple[str, str, int]]:
    """The ``(id, type, epoch)`` recorded since the last call, oldest first; then emptied."""
    with _lock:
        taken = list(RESUMED)
        RESUMED.clear()
    return taken


def stall(ctx: ReclaimedWorkflow) -> None:
    """Say so, then take a few seconds (long enough for a test to interrupt the pass), or
    less: it stops once the engine begins to close, as a handler should."""
    print(f"stalling {ctx.workflow_id}", flush=True)
    deadline = time.monotonic() + 3.0
    while not ctx.ownership.closed and time.monotonic() < deadline:
        time.sleep(0.02)
