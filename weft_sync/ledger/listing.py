"""Listing workflow records: through the status index, or by a scan of every record."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from .. import keys
from ..codec import WorkflowRecord, try_decode_workflow_record
from ..storage.base import Storage

SCAN_PAGE: Final = 500
"""Rows read per scan call; listings page through larger key ranges."""


def list_records(storage: Storage, status: str | None, limit: int | None) -> list[WorkflowRecord]:
    """Decodable workflow records in id order, at most ``limit`` (``None``: all).

    With ``status``, the status index is read and each entry's record is read back (an entry
    whose record does not have that status is skipped); without, every ``wf:`` row is scanned
    and related records (checkpoints, signals, ...) are skipped.
    """
    if limit == 0:
        return []
    found: list[WorkflowRecord] = []
    records = _records_by_status(storage, status) if status else _all_records(storage)
    for record in records:
        found.append(record)
        if limit is not None and len(found) >= limit:
            break
    return found


def _records_by_status(storage: Storage, status: str) -> Iterator[WorkflowRecord]:
    prefix = keys.workflow_status_index(status, "")
    for key, _ in _paged_rows(storage, prefix):
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        if workflow_id is None:
            continue
        record = try_decode_workflow_record(storage.get(keys.workflow(workflow_id)))
        if record is not None and record.status == status:
            yield record


def _all_records(storage: Storage) -> Iterator[WorkflowRecord]:
    prefix = keys.workflow("")
    for key, value in _paged_rows(storage, prefix):
        component = key[len(prefix) :]
        # An encoded id never contains ":", so a colon marks a related record.
        if ":" in component or keys.try_decode_key_component(component) is None:
            continue
        record = try_decode_workflow_record(value)
        if record is not None:
            yield record


def _paged_rows(storage: Storage, prefix: str) -> Iterator[tuple[str, bytes]]:
    cursor: str | None = None
    while True:
        rows = storage.scan(prefix, gt=cursor, limit=SCAN_PAGE)
        yield from rows
        if len(rows) < SCAN_PAGE:
            return
        cursor = rows[-1][0]
