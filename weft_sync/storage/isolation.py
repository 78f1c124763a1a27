"""Per-row fault isolation: batched writes in which a row locked by another session fails alone.

A batched renewal or takeover commits many independent compare-and-sets in one transaction. On a
store with row locks, one row held locked by a foreign session (``SELECT … FOR UPDATE`` left
open, say) would make the whole statement wait, and so fail every claim in the batch. A backend
with :class:`SupportsIsolatedBatches` sends the batch as usual, waiting for locks no longer than
its lock timeout (a lock held for a moment by another writer costs nothing more); if that wait
gives up, it sends the batch again skipping the rows it cannot lock at once, and reports each of
them as a :class:`RowLockedError` in its result slot: that row was not judged, and the caller
retries it later. Every other row is judged and applied as usual.

Callers go through :func:`storage_compare_and_set_many_isolated` and
:func:`storage_conditional_batches_isolated`, which fall back to the plain methods (whose results
are plain ``bool``) on a backend without the capability (SQLite has no row locks: its writers take
the whole file in turn, with a bounded busy timeout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from ..errors import StorageError
from .base import Batch, Storage
from .cas import CasRow, storage_compare_and_set_many


class RowLockedError(StorageError):
    """Another session held a row of this batch locked for longer than the store's lock timeout.

    The batch was not judged. Like any ``StorageError`` its write may, rarely, have committed
    all the same (a connection lost during COMMIT): callers treat it as an ambiguous failure.

    :param key: the locked key.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"the row of key {key!r} stayed locked by another database session for longer than "
            f"the lock timeout, so this write was not judged; retry it later"
        )


Judged = bool | RowLockedError
"""One slot of an isolated batch: committed (``True``), condition failed (``False``), or locked."""


class SupportsIsolatedBatches(Protocol):
    """A store whose batched writes isolate rows locked by another session.

    Both methods behave as ``compare_and_set_many`` / ``conditional_batches`` do, except that a
    row (or batch) touching a row another session held locked for longer than the store's lock
    timeout gets a :class:`RowLockedError` in its slot while the other slots are applied, all
    within about one lock timeout.
    """

    def compare_and_set_many_isolated(self, rows: Sequence[CasRow]) -> list[Judged]: ...

    def conditional_batches_isolated(self, batches: Sequence[Batch]) -> list[Judged]: ...


def _isolating(storage: Storage) -> SupportsIsolatedBatches | None:
    # Looked up on the class: a wrapper that forwards unknown attributes (to gate or fault the
    # calls it knows) must not be bypassed by a method it never heard of.
    kind = type(storage)
    if callable(getattr(kind, "compare_and_set_many_isolated", None)) and callable(
        getattr(kind, "conditional_batches_isolated", None)
    ):
        return cast(SupportsIsolatedBatches, storage)
    return None


def _checked(results: Sequence[Judged], expected: int, method: str) -> list[Judged]:
    if len(results) != expected:
        raise StorageError(
            f"{method}() returned {len(results)} results for {expected} batches; the backend "
            f"breaks the Storage contract"
        )
    return [r if isinstance(r, RowLockedError) else bool(r) for r in results]


def storage_compare_and_set_many_isolated(storage: Storage, rows: Sequence[CasRow]) -> list[Judged]:
    """:func:`~.cas.storage_compare_and_set_many`, with locked rows reported apart."""
    isolating = _isolating(storage)
    if isolating is not None and storage.capabilities.conditional_batch:
        results = isolating.compare_and_set_many_isolated(rows)
        return _checked(results, len(rows), "compare_and_set_many_isolated")
    return list(storage_compare_and_set_many(storage, rows))


def storage_conditional_batches_isolated(
    storage: Storage, batches: Sequence[Batch]
) -> list[Judged]:
    """``storage.conditional_batches(batches)``, with batches on locked rows reported apart."""
    isolating = _isolating(storage)
    if isolating is not None:
        results = isolating.conditional_batches_isolated(batches)
        method = "conditional_batches_isolated"
    else:
        results = list(storage.conditional_batches(batches))
        method = "conditional_batches"
    return _checked(results, len(batches), method)
