"""Wiring ``WEFT_SYNC["HANDLERS"]`` into an ``Ownership``: which workflows it reclaims and drives.

An engine reclaims only workflows whose type has a handler here; the handler runs on the
maintenance thread that took the workflow over, as its new owner, and gets one
:class:`ReclaimedWorkflow`. A handler that raises leaves the workflow claimed and running, and the
next reclaim pass drives it again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weft_sync.codec import WorkflowRecord

if TYPE_CHECKING:
    from weft_sync import Ownership
    from weft_sync.workflows import Workflows

__all__ = ["ReclaimedWorkflow", "bind_handlers"]

Opener = Callable[[Callable[[str], object], Callable[[str, "str | None"], bool]], "Ownership"]


@dataclass(frozen=True, slots=True)
class ReclaimedWorkflow:
    """A workflow this engine has just taken over, handed to the handler of its type."""

    workflow_id: str
    type: str
    epoch: int
    record: WorkflowRecord
    ownership: Ownership
    workflows: Workflows


def bind_handlers(opener: Opener, handlers: Mapping[str, Callable[[Any], object]]) -> Ownership:
    """Open an ``Ownership`` through ``opener`` whose reclaims are driven by ``handlers``.

    :param opener: called with ``on_reclaimed`` and ``is_eligible``; returns the open object.
    :param handlers: workflow type -> handler taking a :class:`ReclaimedWorkflow`.
    """
    table = dict(handlers)
    box: list[Ownership] = []

    def drive(workflow_id: str) -> None:
        ownership = box[0]
        record = ownership.workflows.get(workflow_id)
        epoch = ownership.registry.current_epoch(workflow_id)
        if record is None or epoch is None or record.status != "running":
            return
        table[record.type](
            ReclaimedWorkflow(
                workflow_id=workflow_id,
                type=record.type,
                epoch=epoch,
                record=record,
                ownership=ownership,
                workflows=ownership.workflows,
            )
        )

    def eligible(workflow_type: str, revision: str | None) -> bool:
        return workflow_type in table

    # The ownership does not exist until opened; a reclaim needs it only after the first pass.
    ownership = opener(drive, eligible)
    box.append(ownership)
    return ownership
