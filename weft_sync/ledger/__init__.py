"""Building blocks of the workflow ledger (:mod:`weft_sync.workflows`).

- :mod:`.records` — related-record keys, statuses, payload encoding, the ledger's errors;
- :mod:`.fencing` — fenced writes and the wake-ownership check;
- :mod:`.finishing` — ``complete``/``fail`` with the claim's release folded into the write;
- :mod:`.signals` — the durable signal buffer and its parked waiters;
- :mod:`.updates` — the durable update queue and the owner's handlers.

Hosts use :class:`weft_sync.workflows.Workflows`; these modules are its parts.
"""

from __future__ import annotations

from .fenced_writes import Fence as Fence
from .fenced_writes import WakeCheck as WakeCheck
from .fenced_writes import WakeCheckStatus as WakeCheckStatus
from .fenced_writes import wake_ownership_check as wake_ownership_check
from .records import (
    ExternalCommitConflictError as ExternalCommitConflictError,
)
from .records import (
    WorkflowNotFoundError as WorkflowNotFoundError,
)
from .records import (
    WorkflowOutcome as WorkflowOutcome,
)
from .records import (
    WorkflowStateError as WorkflowStateError,
)
from .signals import SignalBuffer as SignalBuffer
from .updates import UpdateHandler as UpdateHandler
from .updates import UpdateQueue as UpdateQueue
from .updates import WorkflowUpdate as WorkflowUpdate

