"""The ``Report`` and ``ReportEvent`` tables."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[Any]] = []

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Report",
            fields=[
                ("job_id", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("pages", models.PositiveIntegerField()),
                ("pages_done", models.PositiveIntegerField(default=0)),
                ("status", models.CharField(default="running", max_length=16)),
                ("completions", models.PositiveIntegerField(default=0)),
                ("completed_by_pid", models.IntegerField(null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
        migrations.CreateModel(
            name="ReportEvent",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("job_id", models.CharField(db_index=True, max_length=64)),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("resumed", "resumed"),
                            ("completed", "completed"),
                            ("refused", "refused"),
                        ],
                        max_length=16,
                    ),
                ),
                ("page", models.PositiveIntegerField(null=True)),
                ("pid", models.IntegerField()),
                ("engine", models.CharField(max_length=64)),
                ("at", models.FloatField()),
            ],
        ),
    ]
