"""Report jobs: each is a weft_sync workflow of type ``report``, one fenced checkpoint per page.

A job starts in the request that asks for it (:func:`start_report`: the workflow is created and
claimed by this process in one write) and is driven by this process's report threads, each
inside ``workflows.drive()`` (a report thread picks a job up within one renew interval, or the
claim goes to a handler). If the
process dies, another one takes the workflow over and resumes it from its checkpoint with
:func:`resume_report`, which ``settings.WEFT_SYNC["HANDLERS"]`` names. Each page is a fenced
checkpoint in the weft_sync store and a fenced update of the job's ``Report`` row
(``fenced_atomic``). A process that was paused past the claim TTL and wakes up finds its next
write refused (``EngineDeposedError``): it records that and writes nothing more for the job.

The checkpoint is the list of pages written so far, each as ``[page, pid, epoch]``: which
process wrote it, under which fencing epoch.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

from django.conf import settings
from django.db import connections
from django.db.models import F

from weft_sync import (
    EngineDeposedError,
    Ownership,
    ReclaimedWorkflow,
    WeftError,
    WorkflowClaimUnavailableError,
)
from weft_sync.django import fenced_atomic, get_ownership
from weft_sync.workflows import WorkflowStateError

from . import runner
from .models import Report, ReportEvent

__all__ = ["JOB_TYPE", "drive_report", "resume_report", "start_report"]

_log = logging.getLogger(__name__)

JOB_TYPE = "report"
MAX_PAGES = 1000


def start_report(pages: int) -> str:
    """Create a report job of ``pages`` pages, claimed by this process; return its id."""
    if not 1 <= pages <= MAX_PAGES:
        raise ValueError(f"pages must be between 1 and {MAX_PAGES}, got {pages}")
    job_id = uuid.uuid4().hex
    # The row first: whoever drives the workflow, now or after a takeover, finds it.
    Report.objects.create(job_id=job_id, pages=pages)
    get_ownership().workflows.start(job_id, JOB_TYPE, input={"pages": pages})
    runner.submit(job_id, _drive_on_report_thread, settings.REPORT_THREADS)
    return job_id


def resume_report(workflow: ReclaimedWorkflow) -> None:
    """The ``report`` handler: resume a report taken over from a dead or paused process.

    Runs on a handler thread of the engine that took the workflow over, as its new owner (and
    its driver: a report it leaves unfinished is released for a redrive).
    """
    _event(workflow.workflow_id, ReportEvent.RESUMED, workflow.ownership.engine_id)
    drive_report(workflow.ownership, workflow.workflow_id)


def drive_report(ownership: Ownership, job_id: str) -> None:
    """Write the pages after the checkpoint, each fenced as ``ownership``'s, then complete.

    The whole job runs in ``workflows.drive()``: if it raises, or stops early, the claim is
    released at once and a handler (here or in another process) resumes it from its
    checkpoint. The last page's ``Report`` update, the completion event and the workflow's
    ``complete()`` are one transaction (``fenced_atomic``): a process killed in between leaves
    neither, so the report row and the store always agree.

    ``ownership`` is the engine holding the claim: this process's own, or the one a handler was
    given (in ``manage.py weft_sync maintain`` that is the command's engine, not this process's
    ``get_ownership()``).
    """
    workflows = ownership.workflows
    page = 0
    try:
        with workflows.drive(job_id) as ctx:
            record = workflows.get(job_id)
            assert record is not None and isinstance(record.input, dict)
            pages = int(record.input["pages"])
            history = json.loads(workflows.load_checkpoint(job_id) or b"[]")
            done = len(history)
            for page in range(done + 1, pages + 1):
                if runner.STOPPING.wait(settings.REPORT_STEP_SECONDS):
                    # This process is exiting: leaving the block releases the claim, and
                    # another process resumes the report from this checkpoint.
                    return
                history.append([page, os.getpid(), ctx.epoch])
                ctx.checkpoint(json.dumps(history).encode())
                if page < pages:
                    # The project's own row, fenced too: refused once another process took over.
                    with fenced_atomic(job_id, ownership=ownership):
                        Report.objects.filter(pk=job_id).update(pages_done=page)
            result = {"pages": pages, "resumed_after": done, "pid": os.getpid(), "epoch": ctx.epoch}
            with fenced_atomic(job_id, ownership=ownership):
                Report.objects.filter(pk=job_id).update(
                    status="completed",
                    pages_done=pages,
                    completions=F("completions") + 1,
                    completed_by_pid=os.getpid(),
                )
                _event(job_id, ReportEvent.COMPLETED, ownership.engine_id)
                ctx.complete(result)
    except EngineDeposedError as exc:
        # Another process took it over ("deposed"), or this one did for a new driver after
        # losing the claim ("superseded"): either way the new driver finishes it.
        _log.warning("report %s: its write at page %d was refused (%s)", job_id, page, exc.cause)
        _event(job_id, ReportEvent.REFUSED, ownership.engine_id, page=page)
    except (WorkflowClaimUnavailableError, WorkflowStateError):
        # It waited too long in the queue: its claim went to a handler meanwhile, which drives
        # it (or already finished it).
        _log.info("report %s is driven (or was finished) by a handler", job_id)


def _event(job_id: str, kind: str, engine: str, *, page: int | None = None) -> None:
    ReportEvent.objects.create(
        job_id=job_id, kind=kind, page=page, pid=os.getpid(), engine=engine, at=time.time()
    )


def _drive_on_report_thread(job_id: str) -> None:
    try:
        # A failure leaves drive() and so releases the claim: a handler resumes the report.
        drive_report(get_ownership(), job_id)
    except WeftError as exc:
        # The store failed (a lock timeout, a lost connection): nothing to debug in this code.
        _log.warning("report %s stopped (%s); a handler resumes it", job_id, exc)
    except Exception:
        _log.exception("report %s failed; a handler resumes it", job_id)
    finally:
        connections.close_all()
