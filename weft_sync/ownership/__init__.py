"""The :class:`Ownership` facade a host holds, and what it is built from."""

from __future__ import annotations

from .claim_handle import ClaimHandle
from .facade import Background, LostCallback, Ownership, ReclaimedWorkflow, WorkflowHandler

__all__ = [
    "Background",
    "ClaimHandle",
    "LostCallback",
    "Ownership",
    "ReclaimedWorkflow",
    "WorkflowHandler",
]
