"""Settings of the example project: one app, no database, and where the weft_sync store is.

The project serves no requests of its own; it exists to show the ``weft_maintain`` management
command (``reports/management/commands/weft_maintain.py``) in a real Django setup.
"""

from __future__ import annotations

import os
from typing import Any

SECRET_KEY = "example-project-not-a-secret"
DEBUG = False
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["reports"]
DATABASES: dict[str, Any] = {}
USE_TZ = True

WEFT_SYNC_URL = os.environ.get("WEFT_SYNC_URL")
"""The store; ``--url`` overrides it, and without either a SQLite file in a temp dir is used."""

WEFT_SYNC_HANDLERS = {"report": "reports.handlers.resume_report"}
"""Workflow type -> dotted path of the function resuming it; other types are never reclaimed."""
