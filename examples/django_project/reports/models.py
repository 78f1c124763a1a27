"""A report job and what happened to it: the host's own data, in the project's database."""

from __future__ import annotations

from django.db import models


class Report(models.Model):
    """One report job; ``job_id`` is also the id of its weft_sync workflow."""

    job_id = models.CharField(primary_key=True, max_length=64)
    pages = models.PositiveIntegerField()
    pages_done = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, default="running")
    completions = models.PositiveIntegerField(default=0)
    """How many processes completed it: 1 once it is done, never more."""
    completed_by_pid = models.IntegerField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)


class ReportEvent(models.Model):
    """Something a process did to a report: resumed it, completed it, or had a write refused."""

    RESUMED = "resumed"
    COMPLETED = "completed"
    REFUSED = "refused"
    KINDS = ((RESUMED, RESUMED), (COMPLETED, COMPLETED), (REFUSED, REFUSED))

    job_id = models.CharField(max_length=64, db_index=True)
    kind = models.CharField(max_length=16, choices=KINDS)
    page = models.PositiveIntegerField(null=True)
    """The page being written when a write was refused."""
    pid = models.IntegerField()
    engine = models.CharField(max_length=64)
    at = models.FloatField()
    """Seconds since the Unix epoch."""
