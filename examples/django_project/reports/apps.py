"""The ``reports`` app: report workflows and the command that keeps them moving."""

from __future__ import annotations

from django.apps import AppConfig


class ReportsConfig(AppConfig):
    name = "reports"
    verbose_name = "Report workflows"
