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

:func:`discover_reclaim_candidates` also reports what fair takeover needs from the same reads:
which candidates look *stranded* (a holder the scan judged expired or undecodable, or no holder
at all) and how many live claims each other engine holds.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

from .. import _fork, keys
from ..codec import try_decode_workflow_record
from ..storage.base import Storage

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


_fork.reset_in_child(_reset_cursor_lock_in_child)


HolderJudge = Callable[[bytes], "str | None"]
"""Given holder bytes the scan read: the holder's engine id if the claim is live, else ``None``."""


@dataclass(slots=True)
class ReclaimDiscovery:
    """What one discovery found, from one set of reads.

    :param candidates: every id worth a takeover attempt, without duplicates, in scan order.
    :param stranded: the candidates that looked takeover-ready (expired or undecodable holder,
        or a running record with no holder), in scan order.
    :param live_claims: other engines' live claims the holder scan read, per engine id
        (excluded ids are not counted).
    """

    candidates: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)
    live_claims: dict[str, int] = field(default_factory=dict)


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
    if holder_is_live is None:
        return discover_reclaim_candidates(storage, exclude, judge=None).candidates
    is_live = holder_is_live

    def judge(holder_bytes: bytes) -> str | None:
        return "" if is_live(holder_bytes) else None

    return discover_reclaim_candidates(storage, exclude, judge=judge, skip_live=True).candidates


def discover_reclaim_candidates(
    storage: Storage,
    exclude: Collection[str],
    *,
    judge: HolderJudge | None,
    skip_live: bool = False,
) -> ReclaimDiscovery:
    """Run the three scans; classify every holder read with ``judge``.

    :param judge: tells a live holder (its engine id) from a stranded one (``None``). Without a
        judge every holder counts as stranded and no live claims are reported.
    :param skip_live: leave holders judged live out of the candidates (see
        :func:`list_reclaim_candidates`).
    :raises StorageError: a scan or read failed (the cursor does not move then).
    """
    excluded = set(exclude)
    found: dict[str, None] = {}
    found_stranded: dict[str, None] = {}
    live_claims: dict[str, int] = {}
    live: set[str] = set()
    for key, value in storage.scan(_HOLDER_PREFIX):
        workflow_id = _decode_id(key, _HOLDER_PREFIX)
        if workflow_id is None or workflow_id in excluded:
            continue
        engine = None if judge is None else judge(value)
        if engine is not None:
            live_claims[engine] = live_claims.get(engine, 0) + 1
            if skip_live:
                live.add(workflow_id)
                continue
        else:
            found_stranded.setdefault(workflow_id)
        found.setdefault(workflow_id)
    excluded |= live
    for key, _ in storage.scan(_RUNNING_INDEX_PREFIX):
        workflow_id = _decode_id(key, _RUNNING_INDEX_PREFIX)
        if workflow_id is None or workflow_id in excluded or workflow_id in found:
            continue
        if storage.get(keys.workflow_owner_holder(workflow_id)) is None:
            found[workflow_id] = None
            found_stranded[workflow_id] = None
    before = len(found)
    _authoritative_scan(storage, excluded, found)
    for workflow_id in list(found)[before:]:
        found_stranded[workflow_id] = None
    return ReclaimDiscovery(list(found), list(found_stranded), live_claims)


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


decode_key_id = _decode_id


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
