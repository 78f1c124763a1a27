"""weft_sync: durable, fenced per-workflow ownership claims for threaded Python hosts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .claims import ClaimRegistry
from .clock import ManualClock, system_clock
from .errors import (
    EngineDeposedError,
    OwnershipModeMismatchError,
    StorageError,
    WeftError,
    WorkflowClaimLostError,
    WorkflowClaimLostWarning,
    WorkflowClaimUnavailableError,
    WorkflowExistsError,
)
from .metrics import ClaimMetrics
from .options import OwnershipOptions
from .ownership.claim_handle import ClaimHandle
from .ownership.facade import Ownership, ReclaimedWorkflow, WorkflowHandler
from .storage import Condition, Delete, Put, SqliteStorage, open_storage

if TYPE_CHECKING:
    from .storage.postgres.store import PostgresStorage

__version__ = "0.3.0.dev0"
"""The version: a release's number, or the next one's with ``.devN`` between releases (the
changes listed as unreleased in ``CHANGELOG.md``); the package metadata reads it (``setup.cfg``:
``attr: weft_sync.__version__``)."""

__all__ = [
    "ClaimHandle",
    "ClaimMetrics",
    "ClaimRegistry",
    "Condition",
    "Delete",
    "EngineDeposedError",
    "ManualClock",
    "Ownership",
    "OwnershipModeMismatchError",
    "OwnershipOptions",
    "PostgresStorage",
    "Put",
    "ReclaimedWorkflow",
    "SqliteStorage",
    "StorageError",
    "WeftError",
    "WorkflowClaimLostError",
    "WorkflowClaimLostWarning",
    "WorkflowClaimUnavailableError",
    "WorkflowExistsError",
    "WorkflowHandler",
    "open_storage",
    "system_clock",
]


def __getattr__(name: str) -> Any:
    # PostgresStorage needs the optional ``postgres`` extra, so it is imported on first use.
    if name == "PostgresStorage":
        from .storage.postgres.store import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
