"""Unmanaged models that give the admin a place for weft_sync's records; they have no table.

The workflows and claims live in the weft_sync store (a key-value table the admin reads through
the public API), not in Django tables: these models are never queried. They exist so that the
admin lists them, and so that ``weft_sync.cancel_workflow`` is a permission Django can grant.
"""

from __future__ import annotations

from django.db import models


class Workflow(models.Model):
    """A workflow record of the store (read-only in the admin)."""

    workflow_id = models.CharField(primary_key=True, max_length=255)

    class Meta:
        managed = False
        db_table = "weft_sync_workflow_unmanaged"
        default_permissions = ("view",)
        permissions = (("cancel_workflow", "Can cancel a workflow (deposes its owner)"),)
        verbose_name = "workflow"


class Claim(models.Model):
    """A claim (holder record) of the store (read-only in the admin)."""

    workflow_id = models.CharField(primary_key=True, max_length=255)

    class Meta:
        managed = False
        db_table = "weft_sync_claim_unmanaged"
        default_permissions = ("view",)
        verbose_name = "claim"
