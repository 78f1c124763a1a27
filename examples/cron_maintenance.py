"""Cron-style weft_sync maintenance: one pass that reclaims abandoned workflows and resumes them.

Run it from cron next to the processes that start workflows, e.g. every minute::

    * * * * *  python examples/cron_maintenance.py --url postgresql://app@db/app

Each run opens the store with ``background="manual"`` and one handler per workflow type it can
resume, runs exactly one maintenance pass, prints a summary and exits: 0 when the pass went
through, 1 when reclaim discovery failed (the store could not be scanned), a candidate failed or
a handler raised. A workflow counts as abandoned once its owner is seen dead (the pass probes the
engines' session locks: a killed process's claims are taken at once), or once its owner stopped
renewing its claim for longer than the claim TTL plus two renew intervals (a frozen or
partitioned process); the pass then takes the claim over (minting a new epoch, so the old
owner's late writes are refused by the store) and calls the handler for its type with a
``ReclaimedWorkflow``, which resumes it from its last checkpoint. Workflows of types without a
handler are left alone.

Without ``--url`` it uses a SQLite file in a temporary directory. ``--demo`` first leaves there
two "invoice-batch" workflows whose process died an hour ago, part-way through, and one workflow
of a type this script has no handler for (left alone)::

    python examples/cron_maintenance.py --demo
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from weft_sync import ManualClock, Ownership, ReclaimedWorkflow, WorkflowHandler, system_clock
from weft_sync.storage import Storage

INVOICE_BATCH = "invoice-batch"


def resume_invoice_batch(ctx: ReclaimedWorkflow) -> None:
    """Send the invoices not sent yet, checkpointing after each one, then complete.

    Runs on a handler thread of the engine whose pass took the workflow over, as its new owner
    (``ctx.epoch``); ``run_maintenance()`` returns once it has finished. The checkpoint holds
    how many invoices were sent. Every checkpoint is a fenced write: if another process took
    this workflow over meanwhile, it raises ``EngineDeposedError`` and nothing more is written
    from here.
    """
    job = ctx.record.input if isinstance(ctx.record.input, dict) else {}
    total = int(job.get("invoices", 0))
    checkpoint = ctx.workflows.load_checkpoint(ctx.workflow_id)
    done = int(checkpoint) if checkpoint else 0
    for sent in range(done + 1, total + 1):
        ctx.workflows.save_checkpoint(ctx.workflow_id, str(sent).encode())
    ctx.workflows.complete(ctx.workflow_id, result={"sent": total, "resumed_after": done})


HANDLERS: dict[str, WorkflowHandler] = {INVOICE_BATCH: resume_invoice_batch}
"""Workflow type -> how to resume it. Workflows of other types are never taken over here."""


def run_pass(url_or_storage: str | Storage, out: TextIO = sys.stdout) -> int:
    """Run one maintenance pass over the store; print a summary; return the exit code."""
    with Ownership.open(url_or_storage, handlers=HANDLERS, background="manual") as ownership:
        # Returns once the handlers of what the pass took over have run (handler threads).
        result = ownership.run_maintenance()
        # A handler that raised released its claim for a later run: shown as an error.
        raised = ownership.handlers.take_failures()
        reclaim = result.reclaim
        if reclaim is None or reclaim.status == "discovery-failed":
            error = None if reclaim is None else reclaim.error
            print(f"reclaim discovery failed: {error}", file=sys.stderr)
            return 1
        driven = [o for o in reclaim.outcomes if o.status == "reclaimed"]
        out.write(
            f"renewed {result.renewed_count}, reclaimed "
            f"{len([o for o in driven if o.workflow_id not in raised])} of "
            f"{len(reclaim.outcomes)} candidates\n"
        )
        failed = 0
        # Each engine attempts candidates in its own order; print them sorted.
        for outcome in sorted(reclaim.outcomes, key=lambda o: o.workflow_id):
            line = f"  {outcome.workflow_id}: {outcome.status.value}"
            if outcome.workflow_id in raised:
                failed += 1
                line = f"  {outcome.workflow_id}: error ({raised[outcome.workflow_id]!r})"
            elif outcome.status == "reclaimed":
                finished = ownership.workflows.get_outcome(outcome.workflow_id)
                if finished is not None:
                    line += f", {finished.status} with {finished.result}"
            elif outcome.status == "error":
                failed += 1
                line += f" ({outcome.error!r})"
            out.write(line + "\n")
    return 1 if failed else 0


def seed_abandoned(url: str) -> None:
    """Leave workflows whose process died an hour ago, without releasing its claims."""
    an_hour_ago = ManualClock(system_clock() - 3_600_000)
    with Ownership.open(url, background="manual", clock=an_hour_ago) as dead:
        for workflow_id, sent in (("invoices-march", 2), ("invoices-april", 0)):
            dead.workflows.start(workflow_id, INVOICE_BATCH, input={"invoices": 5})
            if sent:
                dead.workflows.save_checkpoint(workflow_id, str(sent).encode())
        dead.workflows.start("payroll-march", "payroll")
        # A killed process releases nothing: the claims stay until they expire.
        for workflow_id in dead.registry.list_held_workflow_ids():
            dead.registry.forget_local_claim(workflow_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="One weft_sync maintenance pass: reclaim and resume abandoned workflows."
    )
    parser.add_argument("--url", help="store URL (default: a SQLite file in a temporary dir)")
    parser.add_argument(
        "--demo", action="store_true", help="first leave abandoned workflows in the store"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weft-cron-") as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'cron.db'}"
        if args.demo:
            seed_abandoned(url)
        return run_pass(url)


if __name__ == "__main__":
    sys.exit(main())
