"""Reclaim candidate discovery: which workflows might have been stranded by a dead engine.

Three scans, in order, each adding only ids not found before and not excluded:

1. **Holders** — every workflow with a holder record (liveness is judged later, by the takeover,
   on a fresh read).
2. **Ownerless running** — every workflow in the ``running`` status index with no holder record
   (e.g. after a graceful release during a rolling handoff).
3. **Authoritative** — a bounded window of at most :data:`AUTHORITATIVE_SCAN_LIMIT` workflow
   records, for stores whose status index was never backfilled: running records without a
   holder. The window rotates: a per-store cursor resumes after the last key read and wraps to
   the start once a window comes back short, so successive passes cover every record.

Keys are decoded strictly: a key whose id component is malformed or not in the canonical
encoding the library writes is skipped, never guessed at.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Final

from .. import keys
from ..codec import try_decode_workflow_record
from ..storage.base import Storage

__all__ = ["AUTHORITATIVE_SCAN_LIMIT", "list_reclaim_candidates"]

_log = logging.getLogger(__name__)

AUTHORITATIVE_SCAN_LIMIT: Final = 500
"""Workflow records the authoritative scan reads per pass."""

_RUNNING: Final = "running"
_HOLDER_PREFIX: Final = keys.workflow_owner_holder("")
_RUNNING_INDEX_PREFIX: Final = keys.workflow_status_index(_RUNNING, "")
_WORKFLOW_PREFIX: Final = keys.workflow("")

# _cursor_lock guards _cursors: per storage object, the last workflow key the authoritative scan
# read. Weak keys, so a closed and dropped store takes its cursor with it and distinct stores
# never share a position.
_cursor_lock = threading.Lock()
_cursors: weakref.WeakKeyDictionary[Storage, str] = weakref.WeakKeyDictionary()


def _reset_cursor_lock_in_child() -> None:
    # Another thread may have held the lock at fork time; the child's copy would never unlock.
    global _cursor_lock
    _cursor_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_cursor_lock_in_child)


def list_reclaim_candidates(
    storage: Storage,
    exclude: Collection[str],
    *,
    holder_is_live: Callable[[bytes], bool] | None = None,
) -> list[str]:
    """Return the ids worth a takeover attempt, without duplicates, in scan order.

    :param storage: the store to scan.
    :param exclude: ids never to return (this engine's own claims).
    :param holder_is_live: given the holder bytes the scan read, ``True`` skips that workflow
        this pass. Only a holder seen live can be skipped, and the takeover re-reads anyway, so
        this saves the reads of a doomed attempt without ever hiding an expired claim for long.
    :raises StorageError: a scan or read failed (the cursor does not move then).
    """
    excluded = set(exclude)
    found: dict[str, None] = {}
    live: set[str] = set()
    for key, value in storage.scan(_HOLDER_PREFIX):
        workflow_id = _decode_id(key, _HOLDER_PREFIX)
        if workflow_id is None or workflow_id in excluded:
            continue
        if holder_is_live is not None and holder_is_live(value):
            live.add(workflow_id)
            continue
        found.setdefault(workflow_id)
    excluded |= live
    for key, _ in storage.scan(_RUNNING_INDEX_PREFIX):
        workflow_id = _decode_id(key, _RUNNING_INDEX_PREFIX)
        if workflow_id is None or workflow_id in excluded or workflow_id in found:
            continue
        if storage.get(keys.workflow_owner_holder(workflow_id)) is None:
            found[workflow_id] = None
    _authoritative_scan(storage, excluded, found)
    return list(found)


def _authoritative_scan(storage: Storage, excluded: set[str], found: dict[str, None]) -> None:
    cursor = _read_cursor(storage)
    rows = storage.scan(_WORKFLOW_PREFIX, gt=cursor, limit=AUTHORITATIVE_SCAN_LIMIT)
    for key, value in rows:
        workflow_id = _decode_id(key, _WORKFLOW_PREFIX)
        if workflow_id is None or workflow_id in excluded or workflow_id in found:
            continue
        record = try_decode_workflow_record(value)
        if record is None or record.status != _RUNNING:
            continue
        if storage.get(keys.workflow_owner_holder(workflow_id)) is None:
            found[workflow_id] = None
    # Every row read counts, skipped ones included: a short window means the end was reached.
    _write_cursor(storage, rows[-1][0] if len(rows) >= AUTHORITATIVE_SCAN_LIMIT else None)


def _decode_id(key: str, prefix: str) -> str | None:
    """The workflow id of ``key`` if ``key`` is exactly ``prefix + enc(id)``, else ``None``."""
    component = key[len(prefix) :]
    workflow_id = keys.try_decode_key_component(component)
    if not workflow_id:
        return None
    # Rejects related records sharing the prefix (``wf:<id>:ckpt``) and non-canonical escapes.
    if keys.encode_key_component(workflow_id) != component:
        return None
    return workflow_id


def _read_cursor(storage: Storage) -> str | None:
    try:
        with _cursor_lock:
            return _cursors.get(storage)
    except TypeError:
        return None


def _write_cursor(storage: Storage, cursor: str | None) -> None:
    try:
        with _cursor_lock:
            if cursor is None:
                _cursors.pop(storage, None)
            else:
                _cursors[storage] = cursor
    except TypeError:
        # A store object that cannot be weakly referenced or hashed gets no cursor: every pass
        # reads the first window.
        _log.debug("no authoritative-scan cursor for %r: it cannot be weakly referenced", storage)
