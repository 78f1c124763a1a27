"""By-engine index entries: which engine holds which claim, readable one engine at a time.

Entry format: key ``wf-owner-by-engine:<enc(engine_id)>:<enc(workflow_id)>``
(:func:`~weft_sync.keys.workflow_owner_by_engine`), value the 8-byte epoch encoding of the
holder's epoch (:func:`~weft_sync.codec.encode_epoch`).

Invariant: for every holder record that decodes, naming engine E at epoch n for workflow W, the
entry (E, W) exists and holds ``encode_epoch(n)``; no entry exists without such a holder. It is
kept exactly because every holder write carries its entry operations in the same conditional
batch: acquire and takeover put the new holder's entry (a takeover also deletes the previous
holder's engine's entry when that engine differs); release, folded release, external rotation
and epoch repair delete the entry of the engine the deleted holder named. Renewal rewrites only
``expires_at``, never the engine or the epoch, so it leaves the entry alone and costs nothing
more. A holder that does not decode has no entry. Whoever reads an entry still judges the claim
on a fresh read of its holder: an entry is a pointer, never evidence.

Stores created before the index existed are brought under the invariant by
:func:`backfill_step`, a few holders at a time, until a sweep finds nothing to fix and writes
:data:`~weft_sync.keys.OWNER_INDEX_MARKER`. Engines of an older version that still write holders
leave those holders without an entry (and leave an entry behind when they release a holder the
backfill indexed); each later sweep repairs what they did, so while they keep writing the marker
may wait, and even once it is written their newer holders lack entries: readers of the index
must find such holders by other means, such as a rotating window over the holder prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgpack

from .. import keys
from ..clock import Clock, system_clock
from ..codec import decode_epoch, decode_holder, encode_epoch
from ..errors import StorageCapabilityError
from ..storage.base import (
    Batch,
    Condition,
    Delete,
    Operation,
    Put,
    Storage,
    storage_conditional_batch,
)
from ..storage.isolation import storage_conditional_batches_isolated
from ..storage.reads import storage_get_many
from .transitions import Fragment, extract_put_value

MARKER_VERSION: Final = 1

_HOLDER_PREFIX: Final = keys.workflow_owner_holder("")
_ENTRY_PREFIX: Final = keys.workflow_owner_by_engine_prefix("")
_PHASE_PREFIX: Final = {"h": _HOLDER_PREFIX, "e": _ENTRY_PREFIX}
_PHASES: Final = tuple(_PHASE_PREFIX)


# -- the entry operations of each transition ---------------------------------------------------


def claim_entry_ops(
    workflow_id: str, engine_id: str, epoch: int, previous_holder_bytes: bytes | None
) -> tuple[Operation, ...]:
    """The entry operations of a claim ``engine_id`` writes at ``epoch`` (acquire, takeover).

    Puts the new holder's entry; deletes the previous holder's engine's entry when those bytes
    decode and name another engine (the same engine's entry is simply overwritten).
    """
    put = Put(keys.workflow_owner_by_engine(engine_id, workflow_id), encode_epoch(epoch))
    previous = decode_holder(previous_holder_bytes)
    if previous is None or previous.engine_id == engine_id:
        return (put,)
    return (Delete(keys.workflow_owner_by_engine(previous.engine_id, workflow_id)), put)


def release_entry_ops(workflow_id: str, holder_bytes: bytes | None) -> tuple[Operation, ...]:
    """The entry operations of deleting the holder ``holder_bytes``: delete its engine's entry.

    Nothing when the bytes are absent or do not decode (such a holder has no entry).
    """
    holder = decode_holder(holder_bytes)
    if holder is None:
        return ()
    return (Delete(keys.workflow_owner_by_engine(holder.engine_id, workflow_id)),)


def with_claim_entry(
    fragment: Fragment, workflow_id: str, engine_id: str, previous_holder_bytes: bytes | None
) -> Fragment:
    """``fragment`` (an acquire or takeover) with its entry operations appended.

    The epoch is the one the fragment puts, so the entry and the holder cannot disagree.
    """
    epoch = decode_epoch(
        extract_put_value(fragment.operations, keys.workflow_owner_epoch(workflow_id))
    )
    if epoch is None:
        raise ValueError(f"the fragment for workflow {workflow_id!r} puts an invalid epoch")
    extra = claim_entry_ops(workflow_id, engine_id, epoch, previous_holder_bytes)
    return Fragment(fragment.conditions, (*fragment.operations, *extra))


def with_release_entry(
    fragment: Fragment, workflow_id: str, holder_bytes: bytes | None
) -> Fragment:
    """``fragment`` (one that deletes the holder ``holder_bytes``) with its entry delete."""
    extra = release_entry_ops(workflow_id, holder_bytes)
    return Fragment(fragment.conditions, (*fragment.operations, *extra)) if extra else fragment


# -- reading ------------------------------------------------------------------------------------


def read_engine_entries(
    storage: Storage, engine_id: str, *, limit: int, after: str | None = None
) -> list[tuple[str, bytes]]:
    """Up to ``limit`` of ``engine_id``'s entries, as ``(workflow id, entry bytes)``.

    In ascending key order, starting after workflow ``after`` (``None``: from the first); pass
    the last id returned to read the next page. Keys that are not canonical entry keys are
    skipped; a page shorter than ``limit`` means no entry is left.

    :raises ValueError: ``engine_id`` is empty or ``limit`` is not a positive int.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id must be a non-empty str, got {engine_id!r}")
    _check_positive("limit", limit)
    prefix = keys.workflow_owner_by_engine_prefix(engine_id)
    gt = None if after is None else keys.workflow_owner_by_engine(engine_id, after)
    found: list[tuple[str, bytes]] = []
    while len(found) < limit:
        wanted = limit - len(found)
        rows = storage.scan(prefix, gt=gt, limit=wanted)
        for key, value in rows:
            decoded = keys.decode_owner_by_engine_key(key)
            if decoded is not None and decoded[0] == engine_id:
                found.append((decoded[1], value))
        if len(rows) < wanted:
            break
        gt = rows[-1][0]
    return found


def index_marker_present(storage: Storage) -> bool:
    """Whether the store says every holder has its entry (a backfill finished a clean sweep)."""
    return storage.get(keys.OWNER_INDEX_MARKER) is not None


# -- backfill -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackfillStep:
    """What one :func:`backfill_step` did.

    :param cursor: pass it to the next step (opaque; ``None`` once done).
    :param written: entries put or deleted by this step.
    :param done: the marker is present: every holder has its entry.
    :param skipped: fixes whose condition failed (the holder or entry moved under them); they
        are retried by a later sweep.
    :param sweep_ended: this step ended a sweep that fixed or skipped something; the next
        step starts the next sweep (a clean sweep ends with ``done`` instead).
    """

    cursor: str | None
    written: int
    done: bool
    skipped: int = 0
    sweep_ended: bool = False


@dataclass(frozen=True, slots=True)
class _Position:
    phase: str  # "h": holders, "e": entries
    dirty: bool  # this sweep fixed or skipped something
    after: str  # the last key handled in this phase ("" at its start)

    def encode(self) -> str:
        return f"{self.phase}{int(self.dirty)}|{self.after}"


def _parse_cursor(cursor: str | None) -> _Position:
    if cursor is None:
        return _Position("h", False, "")
    if (
        isinstance(cursor, str)
        and len(cursor) >= 3
        and cursor[0] in _PHASES
        and cursor[1] in "01"
        and cursor[2] == "|"
        and (cursor[3:] == "" or cursor[3:].startswith(_PHASE_PREFIX[cursor[0]]))
    ):
        return _Position(cursor[0], cursor[1] == "1", cursor[3:])
    raise ValueError(
        f"cursor must be None or a cursor returned by backfill_step(), got {cursor!r:.80}"
    )


def backfill_step(
    storage: Storage, *, cursor: str | None, budget: int, clock: Clock = system_clock
) -> BackfillStep:
    """Bring up to ``budget`` more keys of the store under the index invariant.

    A sweep reads every holder (fixing a missing or wrong entry with a put conditioned on the
    holder bytes read), then every entry (deleting one whose holder is absent, undecodable or
    names another engine, conditioned on the entry bytes and the holder state read, or
    correcting its epoch). Fixes of one scan are independent batches of one
    ``conditional_batches`` call; a batch that lost its condition is skipped and counted, and
    makes the sweep start over once it ends. A sweep that found nothing to fix writes the
    marker. Idempotent and safe with several engines stepping at once.

    :param cursor: ``None`` to start, else the previous step's ``cursor``.
    :param budget: the most holders or entries this step reads.
    :param clock: stamps the marker's ``completed_at`` (milliseconds).
    :raises ValueError: bad ``cursor`` or ``budget``.
    :raises StorageCapabilityError: the store has no conditional batches.
    """
    _check_positive("budget", budget)
    position = _parse_cursor(cursor)
    if not storage.capabilities.conditional_batch:
        raise StorageCapabilityError("the by-engine index backfill", "conditional_batch")
    if index_marker_present(storage):
        return BackfillStep(None, 0, True)
    written = skipped = 0
    left = budget
    while left > 0:
        rows = storage.scan(_PHASE_PREFIX[position.phase], gt=position.after or None, limit=left)
        fix = _holder_fixes if position.phase == "h" else _entry_fixes
        done, lost = _apply(storage, fix(storage, rows))
        written, skipped, left = written + done, skipped + lost, left - len(rows)
        dirty = position.dirty or done > 0 or lost > 0
        if rows and left == 0:
            position = _Position(position.phase, dirty, rows[-1][0])
        elif position.phase == "h":
            position = _Position("e", dirty, "")
        elif dirty:
            return BackfillStep(_Position("h", False, "").encode(), written, False, skipped, True)
        else:
            _write_marker(storage, clock())
            return BackfillStep(None, written, True, skipped)
    return BackfillStep(position.encode(), written, False, skipped)


def _holder_fixes(storage: Storage, rows: Sequence[tuple[str, bytes]]) -> list[Batch]:
    """Puts of the entries the holders in ``rows`` lack (or have with another epoch)."""
    wanted: list[tuple[str, bytes, str, bytes]] = []
    for holder_key, holder_bytes in rows:
        workflow_id = _holder_workflow_id(holder_key)
        holder = decode_holder(holder_bytes)
        if workflow_id is None or holder is None:
            continue
        entry_key = keys.workflow_owner_by_engine(holder.engine_id, workflow_id)
        wanted.append((holder_key, holder_bytes, entry_key, encode_epoch(holder.epoch)))
    current = storage_get_many(storage, [entry_key for _, _, entry_key, _ in wanted])
    return [
        ([Condition(holder_key, holder_bytes)], [Put(entry_key, value)])
        for (holder_key, holder_bytes, entry_key, value), have in zip(wanted, current, strict=True)
        if have != value
    ]


def _entry_fixes(storage: Storage, rows: Sequence[tuple[str, bytes]]) -> list[Batch]:
    """Deletes of the entries in ``rows`` no holder backs, and corrections of wrong epochs."""
    entries = [(key, value, keys.decode_owner_by_engine_key(key)) for key, value in rows]
    decoded = [(key, value, names) for key, value, names in entries if names is not None]
    holder_keys = [keys.workflow_owner_holder(workflow_id) for _, _, (_, workflow_id) in decoded]
    holders = storage_get_many(storage, holder_keys)
    fixes: list[Batch] = []
    for (key, value, (engine_id, _)), holder_key, holder_bytes in zip(
        decoded, holder_keys, holders, strict=True
    ):
        holder = decode_holder(holder_bytes)
        if holder is not None and holder.engine_id == engine_id:
            if value != encode_epoch(holder.epoch):
                fixes.append(
                    ([Condition(holder_key, holder_bytes)], [Put(key, encode_epoch(holder.epoch))])
                )
            continue
        fixes.append(([Condition(key, value), Condition(holder_key, holder_bytes)], [Delete(key)]))
    return fixes


def _apply(storage: Storage, batches: list[Batch]) -> tuple[int, int]:
    """Commit independent fixes in one transaction; return (committed, skipped)."""
    if not batches:
        return 0, 0
    results = storage_conditional_batches_isolated(storage, batches)
    # A locked row (an exception in its slot) was not judged: like a lost condition, retry later.
    committed = sum(1 for result in results if result is True)
    return committed, len(results) - committed


def mark_newborn_store(storage: Storage, now: int) -> bool:
    """Write the index marker on a store that holds no claim yet; return whether it did.

    Called when a store is first stamped with its ownership mode: with no holder and no entry
    in it, every holder it will hold is written by this version, each with its entry, so the
    marker is true from the start and discovery never runs the full scans (nor a backfill) for
    claims written before the store's first maintenance pass. A store that already holds
    claims is left to the backfill, which checks them.
    """
    if any(storage.scan(prefix, limit=1) for prefix in _PHASE_PREFIX.values()):
        return False
    _write_marker(storage, now)
    return index_marker_present(storage)


def _write_marker(storage: Storage, now: int) -> None:
    marker: bytes = msgpack.packb(
        {"version": MARKER_VERSION, "completed_at": now}, use_bin_type=True
    )
    # Another engine's sweep may have written it first: either marker says the same.
    storage_conditional_batch(
        storage, [Condition(keys.OWNER_INDEX_MARKER, None)], [Put(keys.OWNER_INDEX_MARKER, marker)]
    )


def _holder_workflow_id(key: str) -> str | None:
    component = key[len(_HOLDER_PREFIX) :]
    workflow_id = keys.try_decode_key_component(component)
    if not workflow_id or keys.encode_key_component(workflow_id) != component:
        return None
    return workflow_id


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
