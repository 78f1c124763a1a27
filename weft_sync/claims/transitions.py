"""Claim transitions: each builds the conditions and operations of one CAS.

They do no I/O. Every mint of an epoch (acquire, takeover, external rotation) writes a fresh
token (:func:`~weft_sync.codec.mint_token`: the next number and random mint id), so the
operations differ between two builds from the same input; the conditions do not.

Conditions always carry the exact bytes previously read or written, never bytes re-encoded from a
decoded record, so a CAS cannot fail spuriously on a representation difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .. import keys
from ..codec import EPOCH_MAX, HolderRecord, decode_epoch, decode_holder, encode_holder, mint_token
from ..errors import CorruptEpochError, EpochExhaustedError
from ..storage.base import Condition, Delete, Operation, Put

TTL_SAFETY_MULTIPLIER: Final = 3
TAKEOVER_GRACE_MULTIPLIER: Final = 2


@dataclass(frozen=True, slots=True)
class Fragment:
    """The conditions and operations one transition contributes to an atomic write."""

    conditions: tuple[Condition, ...]
    operations: tuple[Operation, ...]


def next_epoch(observed_epoch_bytes: bytes | None, workflow_id: str = "") -> int:
    """The epoch number after the observed one; absent bytes (never claimed) give 1.

    The observed value may be a token or an old-format 8-byte epoch: only its number counts.

    :raises CorruptEpochError: the bytes are present but do not decode: an epoch is never
        minted over them, since anything chosen could repeat one handed out before.
    :raises EpochExhaustedError: the observed epoch is :data:`~weft_sync.codec.EPOCH_MAX`.
    """
    if observed_epoch_bytes is None:
        return 1
    current = decode_epoch(observed_epoch_bytes)
    if current is None:
        raise CorruptEpochError(workflow_id, keys.workflow_owner_epoch(workflow_id))
    if current >= EPOCH_MAX:
        raise EpochExhaustedError(workflow_id, keys.workflow_owner_epoch(workflow_id), current)
    return current + 1


def _claim_puts(
    epoch_key: str, holder_key: str, engine_id: str, epoch: int, now: int, claim_ttl_ms: int
) -> tuple[Operation, ...]:
    holder = HolderRecord(engine_id, epoch, now + claim_ttl_ms, now)
    return (
        Put(epoch_key, mint_token(epoch)),
        Put(holder_key, encode_holder(holder)),
    )


def build_acquire_transition(
    *,
    workflow_id: str,
    engine_id: str,
    now: int,
    claim_ttl_ms: int,
    observed_epoch_bytes: bytes | None,
) -> Fragment:
    """Claim a workflow nobody holds: the holder must be absent, the epoch unchanged.

    :raises CorruptEpochError: the observed epoch bytes are present but corrupt.
    """
    epoch = next_epoch(observed_epoch_bytes, workflow_id)
    epoch_key = keys.workflow_owner_epoch(workflow_id)
    holder_key = keys.workflow_owner_holder(workflow_id)
    return Fragment(
        conditions=(Condition(holder_key, None), Condition(epoch_key, observed_epoch_bytes)),
        operations=_claim_puts(epoch_key, holder_key, engine_id, epoch, now, claim_ttl_ms),
    )


def build_renew_transition(
    *, workflow_id: str, now: int, claim_ttl_ms: int, current_holder_bytes: bytes
) -> Fragment:
    """Extend a held claim; conditioned only on the holder bytes this engine last wrote.

    :raises ValueError: ``current_holder_bytes`` does not decode to a valid holder record.
    """
    current = decode_holder(current_holder_bytes)
    if current is None:
        raise ValueError(
            f"cannot renew workflow {workflow_id!r}: the current holder bytes did not decode "
            f"to a valid holder record"
        )
    renewed = HolderRecord(current.engine_id, current.epoch, now + claim_ttl_ms, current.claimed_at)
    holder_key = keys.workflow_owner_holder(workflow_id)
    return Fragment(
        conditions=(Condition(holder_key, current_holder_bytes),),
        operations=(Put(holder_key, encode_holder(renewed)),),
    )


def build_release_transition(
    *, workflow_id: str, current_epoch_bytes: bytes, current_holder_bytes: bytes
) -> Fragment:
    """Give a claim up: delete the holder if epoch and holder are still ours; keep the epoch."""
    holder_key = keys.workflow_owner_holder(workflow_id)
    return Fragment(
        conditions=(
            Condition(keys.workflow_owner_epoch(workflow_id), current_epoch_bytes),
            Condition(holder_key, current_holder_bytes),
        ),
        operations=(Delete(holder_key),),
    )


def build_takeover_transition(
    *,
    workflow_id: str,
    engine_id: str,
    now: int,
    claim_ttl_ms: int,
    observed_holder_bytes: bytes,
    observed_epoch_bytes: bytes,
) -> Fragment:
    """Replace an expired or garbage holder; the new epoch follows the epoch key, not the holder.

    :raises CorruptEpochError: the observed epoch bytes are corrupt.
    """
    epoch = next_epoch(observed_epoch_bytes, workflow_id)
    epoch_key = keys.workflow_owner_epoch(workflow_id)
    holder_key = keys.workflow_owner_holder(workflow_id)
    return Fragment(
        conditions=(
            Condition(holder_key, observed_holder_bytes),
            Condition(epoch_key, observed_epoch_bytes),
        ),
        operations=_claim_puts(epoch_key, holder_key, engine_id, epoch, now, claim_ttl_ms),
    )


def build_external_rotation_transition(
    *, workflow_id: str, observed_epoch_bytes: bytes | None
) -> Fragment:
    """Depose whoever owns the workflow: bump the epoch and delete the holder.

    Fold it into the same write as a terminal or suspending state change only.

    :raises CorruptEpochError: the observed epoch bytes are present but corrupt.
    """
    return Fragment(
        conditions=(Condition(keys.workflow_owner_epoch(workflow_id), observed_epoch_bytes),),
        operations=(
            Put(
                keys.workflow_owner_epoch(workflow_id),
                mint_token(next_epoch(observed_epoch_bytes, workflow_id)),
            ),
            Delete(keys.workflow_owner_holder(workflow_id)),
        ),
    )


def is_claim_expired(*, expires_at: int, now: int, renew_interval_ms: int) -> bool:
    """Whether a holder is past its grace-adjusted deadline (strictly)."""
    return expires_at + TAKEOVER_GRACE_MULTIPLIER * renew_interval_ms < now


def extract_put_value(operations: Sequence[Operation], key: str) -> bytes:
    """Return the value of the first ``Put`` on ``key``.

    :raises ValueError: no ``Put`` names ``key``.
    """
    for op in operations:
        if isinstance(op, Put) and op.key == key:
            return op.value
    raise ValueError(f'expected a "put" operation for key "{key}" among the operations')
