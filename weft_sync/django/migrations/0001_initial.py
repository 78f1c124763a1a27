"""The unmanaged admin models: no table is created (``managed = False``)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[Any]] = []

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Workflow",
            fields=[
                ("workflow_id", models.CharField(max_length=255, primary_key=True, serialize=False))
            ],
            options={
                "verbose_name": "workflow",
                "db_table": "weft_sync_workflow_unmanaged",
                "managed": False,
                "default_permissions": ("view",),
                "permissions": (("cancel_workflow", "Can cancel a workflow (deposes its owner)"),),
            },
        ),
        migrations.CreateModel(
            name="Claim",
            fields=[
                ("workflow_id", models.CharField(max_length=255, primary_key=True, serialize=False))
            ],
            options={
                "verbose_name": "claim",
                "db_table": "weft_sync_claim_unmanaged",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
