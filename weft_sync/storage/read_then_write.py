"""Read some keys and write what follows from them, in one transaction.

An acquire reads a workflow's holder and epoch, then writes epoch + 1 on the condition that both
are still what it read. Done as a read and a separate compare-and-swap, that is two
transactions; ``read_then_write(keys, decide)`` does it in one, as a hand-written transaction
would: it reads ``keys`` inside the write transaction, calls ``decide`` with the values, and
applies the conditional batch ``decide`` returns (or nothing, when it returns ``None``).

The method is optional: :func:`storage_read_then_write` uses it when a backend has it and falls
back to a read (``get_many``) and a ``conditional_batch`` otherwise. For the two to agree,
``decide`` must condition its batch on every key it read, with the value it was given (a native
backend holds those keys still, so the conditions hold there by construction; the fallback needs
them). ``decide`` runs inside the transaction, possibly on another thread of the store (SQLite's
writer, for a request that joined a group commit): it must be quick and do no I/O. What it raises
propagates to the caller, and nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import StorageCapabilityError, StorageError
from .base import Condition, Operation, Storage, storage_conditional_batch
from .reads import storage_get_many

Decision = tuple[Sequence[Condition], Sequence[Operation]]
"""The conditional batch ``decide`` returns: conditions, then operations."""

Decide = Callable[[list[bytes | None]], Decision | None]
"""Called with the values of the keys read (``None``: absent), in their order."""


class SupportsReadThenWrite(Protocol):
    """A store with a native ``read_then_write``.

    ``read_then_write(keys, decide)`` opens one write transaction, reads ``keys`` in it (so that
    no other writer changes them until it ends: SQLite's write lock, PostgreSQL's row locks and,
    for an absent key, the insert of it), calls ``decide`` with their values and applies the
    returned batch exactly as ``conditional_batch`` would (conditions on the keys read are judged
    against the values read). It returns the values read and whether the batch committed
    (``False`` when ``decide`` returned ``None`` or a condition failed, with nothing written).
    Bad keys raise ``TypeError``/``ValueError`` before any I/O, a bad batch before any write;
    what ``decide`` raises propagates; driver failures raise ``StorageError``.
    """

    def read_then_write(
        self, keys: Sequence[str], decide: Decide
    ) -> tuple[list[bytes | None], bool]: ...


def storage_read_then_write(
    storage: Storage, keys: Sequence[str], decide: Decide
) -> tuple[list[bytes | None], bool]:
    """Read ``keys`` and apply what ``decide`` makes of them: in one transaction if the store
    can, else as a read and a conditional batch (see the module docstring).

    :raises StorageCapabilityError: the backend does not declare ``conditional_batch`` (before
        any I/O; ``decide`` is not called).
    :raises StorageError: the backend returned the wrong number of values (or failed).
    """
    if not storage.capabilities.conditional_batch:
        raise StorageCapabilityError("read_then_write", "conditional_batch")
    # getattr rather than isinstance on a protocol: the check would cost more than the rest of
    # an acquire's Python work.
    native = getattr(storage, "read_then_write", None)
    if native is None:
        values = storage_get_many(storage, keys)
        decision = decide(values)
        if decision is None:
            return values, False
        return values, storage_conditional_batch(storage, *decision)
    values, committed = native(keys, decide)
    if len(values) != len(keys):
        raise StorageError(
            f"read_then_write() returned {len(values)} values for {len(keys)} keys; the backend "
            f"breaks the Storage contract"
        )
    return list(values), bool(committed)
