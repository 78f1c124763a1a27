"""Building blocks of the workflow ledger (:mod:`weft_sync.workflows`).

- :mod:`.records` — related-record keys, statuses, payload encoding, the ledger's errors;
- :mod:`.fencing` — fenced writes and the wake-ownership check;
- :mod:`.finishing` — ``complete``/``fail`` with the claim's release folded into the write;
- :mod:`.signals` — the durable signal buffer and its parked waiters;
- :mod:`.updates` — the durable update queue and the owner's handlers.

Hosts use :class:`weft_sync.workflows.Workflows`; these modules are its parts.
"""

from __future__ import annotations

from .fenced_writes import Fence, WakeCheck, WakeCheckStatus, wake_ownership_check
from .records import (
    ExternalCommitConflictError,
    WorkflowNotFoundError,
    WorkflowOutcome,
    WorkflowStateError,
)
from .signals import SignalBuffer
from .updates import UpdateHandler, UpdateQueue, WorkflowUpdate

__all__ = [
    "ExternalCommitConflictError",
    "Fence",
    "SignalBuffer",
    "UpdateHandler",
    "UpdateQueue",
    "WakeCheck",
    "WakeCheckStatus",
    "WorkflowNotFoundError",
    "WorkflowOutcome",
    "WorkflowStateError",
    "WorkflowUpdate",
    "wake_ownership_check",
]
