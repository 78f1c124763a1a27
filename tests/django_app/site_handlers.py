"""Handlers the integration tests' settings name, and one dotted path that is not callable."""

from __future__ import annotations

import threading
from typing import Any

from django.db import connection

HANDLED: list[tuple[str, str, int, str]] = []
"""(workflow id, type, epoch, thread name) of every call of :func:`finish_report`."""
CONNECTIONS: list[Any] = []
"""The DBAPI connection each call of :func:`finish_report` queried through."""
_lock = threading.Lock()  # guards HANDLED and CONNECTIONS

NOT_CALLABLE = 42


def finish_report(workflow: Any) -> None:
    """Complete the workflow as its new owner, after a query on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    with _lock:
        CONNECTIONS.append(connection.connection)
        HANDLED.append(
            (workflow.workflow_id, workflow.type, workflow.epoch, threading.current_thread().name)
        )
    workflows = workflow.workflows
    workflows.save_checkpoint(workflow.workflow_id, b"resumed")
    workflows.complete(workflow.workflow_id, result={"by": workflow.ownership.engine_id})
