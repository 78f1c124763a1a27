"""Keys, statuses, payload encoding and errors shared by the workflow ledger.

Every key of one workflow's related records starts with ``wf:<enc(id)>:`` (the record key plus a
colon). An encoded id never contains ``:``, so that prefix names exactly one workflow's records:

- ``wf:<id>:ckpt`` — the host's checkpoint (opaque bytes);
- ``wf:<id>:result`` — the outcome of a completed or failed workflow (MessagePack map);
- ``wf:<id>:signal:<enc(name)>:<seq>`` — one buffered signal (MessagePack map);
- ``wf:<id>:update:<seq>`` — one pending update (MessagePack map).

``<seq>`` sorts by sender clock, then by a per-sender counter, and ends in random hex so that two
senders never write the same key.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack

from .. import _fork, keys
from ..codec import (
    WORKFLOW_STATUSES,
    WorkflowRecord,
    decode_workflow_record,
    encode_workflow_record,
)
from ..errors import WeftError
from ..storage.base import Condition, Delete, Operation, Put, Storage

TERMINAL_STATUSES: Final = frozenset({"completed", "failed", "cancelled", "timed-out"})
"""Statuses a workflow never leaves (only ``purge`` removes it)."""

ACTIVE_STATUSES: Final = frozenset({"pending", "running", "suspended"})
"""Statuses that accept signals, updates and external transitions."""

MAX_NAME_LENGTH: Final = 1024


class WorkflowNotFoundError(WeftError, LookupError):
    """No record exists for the workflow.

    :param workflow_id: the workflow that was looked up.
    """

    def __init__(self, workflow_id: str) -> None:
        self.workflow_id = workflow_id
        super().__init__(
            f"workflow {workflow_id!r} does not exist (no record under "
            f"{keys.workflow(workflow_id)!r}); start it first, or check the id"
        )


class WorkflowStateError(WeftError, ValueError):
    """The workflow's status does not allow the requested operation.

    :param workflow_id: the workflow.
    :param status: its current status.
    :param operation: what was attempted, e.g. ``"cancel"``.
    :param allowed: the statuses the operation accepts.
    """

    def __init__(
        self, workflow_id: str, status: str, operation: str, allowed: Iterable[str]
    ) -> None:
        self.workflow_id = workflow_id
        self.status = status
        self.operation = operation
        self.allowed = tuple(sorted(allowed))
        final = " (a final status)" if status in TERMINAL_STATUSES else ""
        super().__init__(
            f"cannot {operation} workflow {workflow_id!r}: its status is {status!r}{final}; "
            f"{operation} needs one of {', '.join(self.allowed)}"
        )


class ExternalCommitConflictError(WeftError):
    """An external commit kept losing its precondition to concurrent writers.

    :param workflow_id: the workflow.
    :param operation: what was attempted, e.g. ``"cancel"``.
    :param attempts: how many compare-and-swap attempts were made.
    """

    def __init__(self, workflow_id: str, operation: str, attempts: int) -> None:
        self.workflow_id = workflow_id
        self.operation = operation
        self.attempts = attempts
        super().__init__(
            f"the {operation} commit for workflow {workflow_id!r} lost its precondition "
            f"{attempts} times in a row (the record or the epoch kept changing under it); "
            f"nothing was written by the failed attempts; retry later"
        )


@dataclass(frozen=True, slots=True)
class WorkflowOutcome:
    """What a completed or failed workflow ended with (``wf:<id>:result``).

    ``result`` is set for ``completed``, ``error`` for ``failed``; ``finished_at`` is ms.
    """

    workflow_id: str
    status: str
    result: Any = None
    error: Any = None
    finished_at: int = 0


# -- keys ------------------------------------------------------------------------------------


def related_prefix(workflow_id: str) -> str:
    """Prefix of every related record of ``workflow_id`` (never the record key itself)."""
    return keys.workflow(workflow_id) + ":"


def checkpoint_key(workflow_id: str) -> str:
    """Key of the workflow's checkpoint."""
    return keys.workflow(workflow_id) + ":ckpt"


def result_key(workflow_id: str) -> str:
    """Key of the workflow's final outcome."""
    return keys.workflow(workflow_id) + ":result"


def signal_prefix(workflow_id: str, name: str) -> str:
    """Prefix of the buffered signals called ``name`` (oldest first in key order)."""
    return keys.workflow(workflow_id) + ":signal:" + keys.encode_key_component(name) + ":"


def update_prefix(workflow_id: str) -> str:
    """Prefix of the workflow's pending updates (oldest first in key order)."""
    return keys.workflow(workflow_id) + ":update:"


# _sequence_lock guards _counter: one sequence per process keeps same-millisecond keys in send
# order.
_sequence_lock = threading.Lock()
_counter = itertools.count()


def _reset_sequence_lock_in_child() -> None:
    # Another thread may have held the lock at fork time; the child's copy would never unlock.
    global _sequence_lock
    _sequence_lock = threading.Lock()


_fork.reset_in_child(_reset_sequence_lock_in_child)


def new_sequence(now_ms: int) -> str:
    """A unique key suffix that sorts by ``now_ms`` first, then by call order in this process."""
    with _sequence_lock:
        n = next(_counter)
    return f"{max(now_ms, 0):015d}-{n:012d}-{os.urandom(6).hex()}"


# -- validation and payloads -----------------------------------------------------------------


def validate_status(status: object) -> str:
    """Return ``status`` if it is a workflow status, else raise naming the valid ones."""
    if not isinstance(status, str) or status not in WORKFLOW_STATUSES:
        raise ValueError(
            f"workflow status must be one of {', '.join(WORKFLOW_STATUSES)}, got {status!r}"
        )
    return status


def validate_name(what: str, name: object) -> str:
    """Return ``name`` if it can name a workflow type, signal or update, else raise.

    :raises TypeError: not a ``str``.
    :raises ValueError: empty, too long, or holding a lone surrogate.
    """
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__} {name!r:.80}")
    if not name:
        raise ValueError(f"{what} must be a non-empty string, got ''")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"{what} {name[:40]!r}... is {len(name)} characters long; the limit is "
            f"{MAX_NAME_LENGTH}"
        )
    keys.encode_key_component(name)  # raises ValueError naming a lone surrogate
    return name


def pack_payload(what: str, data: dict[str, Any]) -> bytes:
    """MessagePack-encode ``data``; raise ``ValueError`` naming ``what`` if it cannot be."""
    try:
        packed: bytes = msgpack.packb(data, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{what} cannot be stored as MessagePack: {exc}") from None
    return packed


def decode_payload_map(raw: bytes) -> dict[str, Any] | None:
    """Decode a MessagePack map written by :func:`pack_payload`; ``None`` if it is not one."""
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    return value if isinstance(value, dict) else None


# -- records ---------------------------------------------------------------------------------


def read_record(storage: Storage, workflow_id: str) -> tuple[bytes, WorkflowRecord] | None:
    """Read ``wf:<id>``: the exact bytes (for CAS conditions) and the decoded record.

    :raises ValueError: the stored bytes are not a valid workflow record.
    """
    raw = storage.get(keys.workflow(workflow_id))
    if raw is None:
        return None
    try:
        return raw, decode_workflow_record(raw)
    except ValueError:
        raise ValueError(
            f"the record of workflow {workflow_id!r} ({keys.workflow(workflow_id)!r}) is not a "
            f"valid workflow record; purge the workflow or repair the key"
        ) from None


def status_change_operations(
    old_bytes: bytes, old: WorkflowRecord, new: WorkflowRecord
) -> tuple[list[Condition], list[Operation]]:
    """Conditions and operations that replace ``old`` by ``new`` and move its index entry.

    The write is conditioned on the exact bytes read, so it commits only over the record the
    caller decided on; record and index always change in the same write.
    """
    record_key = keys.workflow(old.workflow_id)
    operations: list[Operation] = [Put(record_key, encode_workflow_record(new))]
    if new.status != old.status:
        operations.append(Delete(keys.workflow_status_index(old.status, old.workflow_id)))
        operations.append(Put(keys.workflow_status_index(new.status, new.workflow_id), b""))
    return [Condition(record_key, old_bytes)], operations


def with_status(record: WorkflowRecord, status: str, now: int) -> WorkflowRecord:
    """``record`` moved to ``status`` at ``now`` (``updated_at`` never moves backwards)."""
    return replace(record, status=status, updated_at=max(now, record.updated_at))
