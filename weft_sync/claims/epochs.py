"""Corrupt epoch keys: how to find them and how an operator repairs one.

An epoch key that does not decode (wrong length, zero, beyond the safe-integer range) is never
minted over: acquire, takeover and external rotation raise
:class:`~weft_sync.errors.CorruptEpochError` for that workflow, because any epoch chosen without
knowing the lost value could repeat one handed out before, and a stale owner still caching it
would pass the fence again. The workflow stays refused until an operator runs
:func:`repair_corrupt_epoch`, which writes an epoch above anything that can have been handed out
and deposes the current holder in the same compare-and-swap. :func:`find_corrupt_epochs` lists
the corrupt keys (for ``weft-sync doctor``).

Why the repaired epoch is safe: every epoch is the previous one plus 1, one per change of owner,
so an epoch handed out by time ``t`` is at most the number of owner changes of that workflow up
to ``t``. The repair writes ``now_ms * REPAIR_EPOCHS_PER_MS`` (at least one above the holder's
epoch and above ``at_least``), which exceeds every earlier epoch as long as the workflow changed
owner fewer than :data:`REPAIR_EPOCHS_PER_MS` times per millisecond on average since 1970, and
exceeds the result of any earlier repair plus the changes since it under the same bound.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from .. import keys
from ..clock import Clock, system_clock
from ..codec import EPOCH_MAX, decode_epoch, decode_holder, mint_token
from ..keys import try_decode_key_component, validate_workflow_id
from ..storage.base import Condition, Delete, Operation, Put, Storage, storage_conditional_batch
from .engine_index import release_entry_ops

_log = logging.getLogger(__name__)

REPAIR_EPOCHS_PER_MS: Final = 1000
"""Scale of the time-derived epoch a repair writes (see the module docstring)."""

_PAGE: Final = 1000


@dataclass(frozen=True, slots=True)
class CorruptEpoch:
    """One epoch key whose value does not decode.

    :param key: the epoch key.
    :param workflow_id: the workflow it belongs to, or ``None`` when the key itself does not
        decode (then it belongs to no valid workflow id and is never read by a claim).
    :param size: the length of the stored value in bytes.
    """

    key: str
    workflow_id: str | None
    size: int


def iter_corrupt_epochs(storage: Storage) -> Iterator[CorruptEpoch]:
    """Yield every corrupt epoch key, in key order, reading a page of keys at a time."""
    prefix = keys.workflow_owner_epoch("")
    after: str | None = None
    while True:
        page = list(
            storage.scan(prefix, limit=_PAGE)
            if after is None
            else storage.scan(prefix, gt=after, limit=_PAGE)
        )
        for key, value in page:
            if decode_epoch(value) is None:
                yield CorruptEpoch(key, try_decode_key_component(key[len(prefix) :]), len(value))
        if len(page) < _PAGE:
            return
        after = page[-1][0]


def find_corrupt_epochs(storage: Storage, *, limit: int | None = None) -> list[CorruptEpoch]:
    """List the corrupt epoch keys (at most ``limit`` of them); read-only.

    :raises ValueError: ``limit`` is not ``None`` or an int >= 0.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    found: list[CorruptEpoch] = []
    for corrupt in iter_corrupt_epochs(storage):
        if limit is not None and len(found) >= limit:
            break
        found.append(corrupt)
    return found


def repair_corrupt_epoch(
    storage: Storage,
    workflow_id: str,
    *,
    clock: Clock = system_clock,
    at_least: int | None = None,
) -> int:
    """Replace a corrupt epoch with one above any handed out, and depose its holder.

    One compare-and-swap, conditioned on the corrupt bytes and the holder read: it writes the new
    epoch and deletes the holder record, so whoever held the workflow is deposed (its fenced
    writes already fail) and the workflow can be resumed or reclaimed at the new epoch.

    :param at_least: a lower bound the operator knows is above every epoch handed out.
    :returns: the epoch written.
    An exhausted epoch (``EPOCH_MAX``, see :class:`~weft_sync.errors.EpochExhaustedError`) is
    repaired too; the epoch written is a fresh token (new mint id).

    :raises ValueError: the epoch key is absent or neither corrupt nor exhausted; ``at_least``
        is not an int in ``1 .. EPOCH_MAX``; or the time-derived epoch would leave the safe range.
    :raises RuntimeError: the epoch or holder changed while repairing (run it again).
    """
    wid = validate_workflow_id(workflow_id)
    if at_least is not None and (
        isinstance(at_least, bool) or not isinstance(at_least, int) or not 1 <= at_least < EPOCH_MAX
    ):
        raise ValueError(f"at_least must be an int from 1 to {EPOCH_MAX - 1}, got {at_least!r}")
    epoch_key, holder_key = keys.workflow_owner_epoch(wid), keys.workflow_owner_holder(wid)
    corrupt = storage.get(epoch_key)
    if corrupt is None:
        raise ValueError(f"workflow {wid!r} has no epoch key {epoch_key!r}: nothing to repair")
    stored = decode_epoch(corrupt)
    exhausted = stored == EPOCH_MAX
    if stored is not None and not exhausted:
        raise ValueError(
            f"the epoch key {epoch_key!r} holds a valid epoch ({stored}): it is "
            f"not corrupt, so it is left as it is"
        )
    holder_bytes = storage.get(holder_key)
    holder = decode_holder(holder_bytes)
    # An exhausted epoch cannot be exceeded: the fresh mint id alone keeps the new token apart
    # from every earlier one, so the number restarts from the clock.
    epoch = max(
        clock() * REPAIR_EPOCHS_PER_MS,
        0 if holder is None or holder.epoch >= EPOCH_MAX else holder.epoch + 1,
        0 if at_least is None else at_least,
    )
    if not 1 <= epoch <= EPOCH_MAX:
        raise ValueError(
            f"the repaired epoch {epoch} for workflow {wid!r} is outside 1 .. {EPOCH_MAX}; pass "
            f"at_least= with a value known to exceed every epoch handed out"
        )
    operations: list[Operation] = [Put(epoch_key, mint_token(epoch))]
    if holder_bytes is not None:
        operations.append(Delete(holder_key))
        operations += release_entry_ops(wid, holder_bytes)
    conditions = [Condition(epoch_key, corrupt), Condition(holder_key, holder_bytes)]
    if not storage_conditional_batch(storage, conditions, operations):
        raise RuntimeError(
            f"the epoch or holder of workflow {wid!r} changed while it was being repaired; run "
            f"the repair again"
        )
    _log.warning(
        "repaired the corrupt epoch key %r of workflow %r: it now holds epoch %d%s",
        epoch_key,
        wid,
        epoch,
        " and its holder was deposed" if holder_bytes is not None else "",
    )
    return epoch
