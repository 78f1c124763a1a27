"""The bodies of the ``weft-sync`` commands; each returns an exit code and writes to ``out``.

Read-only commands (``claims``, ``workflows``, ``show``, ``status``, ``metrics``, ``doctor``
without ``--fix``) open the store with ``read_only=True``: they never create a file, a table or
a lock file, and never write.
"""

from __future__ import annotations

from .doctor import doctor
from .listing import claims, show, workflows
from .maintain import StopSignals, maintain
from .operate import cancel, demo, release, repair_epoch
from .output import CommandError, NotFound, StoreMissing, StoreRef, UsageError, one_line
from .store_view import metrics, status

__all__ = [
    "CommandError",
    "NotFound",
    "StopSignals",
    "StoreMissing",
    "StoreRef",
    "UsageError",
    "cancel",
    "claims",
    "demo",
    "doctor",
    "maintain",
    "metrics",
    "one_line",
    "release",
    "repair_epoch",
    "show",
    "status",
    "workflows",
]
