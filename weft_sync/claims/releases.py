"""Claim release: on its own, folded into the caller's own write, or for every held claim.

A release deletes the holder record, conditioned on the exact epoch and holder bytes this engine
last wrote; the epoch key is kept. While a workflow is being released (or a folded release is
prepared and not yet finished), renewals of it return ``not-held``; a renewal already in flight is
waited for first. When the release's holder condition fails and the entry has values of renewals
whose commit raised (see :class:`~weft_sync.claims.tracking.TrackedClaim`), the holder is read
again, and if it is one of them the release is retried from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

from .. import keys
from ..storage.base import Storage, storage_conditional_batch
from .engine_index import with_release_entry
from .results import ReleaseResult, ReleaseStatus
from .tracking import ClaimTable, TrackedClaim
from .transitions import Fragment, build_release_transition

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

RELEASE_ALL_CONCURRENCY: Final = 16
# Past release_all's deadline a renewal in flight is still waited for this long: a store that
# bounds its lock waits by the same deadline ends that renewal within it.
_IN_FLIGHT_GRACE_S: Final = 0.5

_T = TypeVar("_T")


class _RenewalOutlasted(Exception):
    """A renewal in flight outlasted ``release_all``'s deadline; the claim was not released."""


class _FoldToken:
    """Identifies the entry a folded release was prepared from; ``finished`` is set once."""

    __slots__ = ("entry", "finished")

    def __init__(self, entry: TrackedClaim) -> None:
        self.entry = entry
        # Guarded by the claim table's lock.
        self.finished = False


@dataclass(frozen=True, slots=True)
class ReleasePreparation:
    """A release fragment to fold into the caller's own atomic write.

    :param workflow_id: the workflow being released.
    :param fragment: conditions (epoch key == ``epoch_bytes``, holder key == ``holder_bytes``)
        and the holder delete; add every one of them to the caller's write.
    :param epoch: the epoch being released.
    :param epoch_bytes: the exact epoch bytes the fragment is conditioned on (the fence).
    :param holder_bytes: the exact holder bytes the fragment is conditioned on.
    :param token: opaque; ties the preparation to the tracked claim it was built from.
    """

    workflow_id: str
    fragment: Fragment
    epoch: int
    epoch_bytes: bytes
    holder_bytes: bytes
    token: object = field(repr=False, compare=False)


class Releases:
    """The registry's release part; ids and epochs reaching it are already validated.

    :param table: the registry's tracking state.
    :param storage: the shared store.
    """

    def __init__(self, table: ClaimTable, storage: Storage) -> None:
        self._table = table
        self._storage = storage

    # -- standalone release ----------------------------------------------------------------

    def release(
        self, wid: str, expected_epoch: int | None, deadline: float | None = None
    ) -> ReleaseResult:
        """See :meth:`ClaimRegistry.release <weft_sync.claims.registry.ClaimRegistry.release>`.

        :raises _RenewalOutlasted: with a ``deadline``, when a renewal in flight outlasts it;
            the claim is then forgotten here, its holder left to expire in the store.
        """
        in_flight = self._table.begin_release(wid)
        try:
            if in_flight is not None:
                _log.debug("release of workflow %r waits for the renewal in flight", wid)
                # Waits without raising: the renewal's own caller sees its error.
                if not in_flight.done.wait(_wait_for(deadline)):
                    self._forget(wid)
                    raise _RenewalOutlasted("a renewal in flight outlasted close()'s timeout")
            return self._release_tracked(wid, expected_epoch)
        finally:
            self._table.end_release(wid)

    def _forget(self, wid: str) -> None:
        entry = self._table.get(wid)
        if entry is not None:
            self._table.drop_if_same(wid, entry)

    def _release_tracked(self, wid: str, expected_epoch: int | None) -> ReleaseResult:
        table = self._table
        with table.lock:
            entry = table.claims.get(wid)
            cached = None if entry is None else (entry.epoch_bytes, entry.holder_bytes)
            pending = () if entry is None else entry.pending
        if (
            entry is None
            or cached is None
            or (expected_epoch is not None and entry.epoch != expected_epoch)
        ):
            _log.debug(
                "release of workflow %r: not held at epoch %r (tracked epoch %r)",
                wid,
                expected_epoch,
                None if entry is None else entry.epoch,
            )
            return ReleaseResult(ReleaseStatus.NOT_HELD, wid)
        epoch_bytes, holder_bytes = cached
        try:
            committed = self._commit(wid, epoch_bytes, holder_bytes)
            if not committed and pending:
                observed = self._storage.get(keys.workflow_owner_holder(wid))
                if observed is not None and observed in pending:
                    _log.debug(
                        "release of workflow %r: an earlier renewal had committed although it "
                        "raised; releasing from it",
                        wid,
                    )
                    committed = self._commit(wid, epoch_bytes, observed)
        finally:
            table.drop_if_same(wid, entry)
        if committed:
            _log.debug("released the claim on workflow %r at epoch %d", wid, entry.epoch)
            return ReleaseResult(ReleaseStatus.RELEASED, wid)
        _log.info(
            "release of workflow %r at epoch %d found the claim already moved on", wid, entry.epoch
        )
        return ReleaseResult(ReleaseStatus.LOST_RACE, wid)

    def _commit(self, wid: str, epoch_bytes: bytes, holder_bytes: bytes) -> bool:
        fragment = _release_fragment(wid, epoch_bytes, holder_bytes)
        return storage_conditional_batch(self._storage, fragment.conditions, fragment.operations)

    # -- folded release --------------------------------------------------------------------

    def prepare(
        self, wid: str, expected_epoch: int | None, *, wait: bool = True
    ) -> ReleasePreparation | None:
        """See :meth:`ClaimRegistry.prepare_release_fragment
        <weft_sync.claims.registry.ClaimRegistry.prepare_release_fragment>`.
        """
        table = self._table
        in_flight = table.begin_release(wid)
        preparation: ReleasePreparation | None = None
        try:
            if in_flight is not None and wait:
                _log.debug("release of workflow %r waits for the renewal in flight", wid)
                in_flight.done.wait()
            entry = table.get(wid)
            if entry is not None and (expected_epoch is None or entry.epoch == expected_epoch):
                self._resolve_pending(wid, entry)
                preparation = self._build(wid, entry)
            if preparation is None:
                _log.debug(
                    "folded release of workflow %r: not held at epoch %r", wid, expected_epoch
                )
            return preparation
        finally:
            if preparation is None:
                table.end_release(wid)

    def _resolve_pending(self, wid: str, entry: TrackedClaim) -> None:
        """Adopt the holder if it is a value of a renewal whose commit raised but landed."""
        with self._table.lock:
            pending = entry.pending
        if pending:
            observed = self._storage.get(keys.workflow_owner_holder(wid))
            if self._table.adopt_pending(wid, entry, observed):
                _log.debug(
                    "an earlier renewal of workflow %r had committed although it raised; "
                    "releasing from it",
                    wid,
                )

    def _build(self, wid: str, entry: TrackedClaim) -> ReleasePreparation | None:
        with self._table.lock:
            if self._table.claims.get(wid) is not entry:
                return None
            epoch_bytes, holder_bytes = entry.epoch_bytes, entry.holder_bytes
        fragment = _release_fragment(wid, epoch_bytes, holder_bytes)
        _log.debug("prepared a release fragment for workflow %r at epoch %d", wid, entry.epoch)
        return ReleasePreparation(
            wid, fragment, entry.epoch, epoch_bytes, holder_bytes, _FoldToken(entry)
        )

    def finish(self, wid: str, preparation: ReleasePreparation, committed: bool) -> None:
        """See :meth:`ClaimRegistry.finish_folded_release
        <weft_sync.claims.registry.ClaimRegistry.finish_folded_release>`.
        """
        token = preparation.token
        if not isinstance(token, _FoldToken) or preparation.workflow_id != wid:
            raise ValueError(
                f"the preparation was made for workflow {preparation.workflow_id!r}, not "
                f"{wid!r}; pass the one prepare_release_fragment({wid!r}) returned"
            )
        table = self._table
        with table.lock:
            if token.finished:
                return
            token.finished = True
            dropped = committed and table.claims.get(wid) is token.entry
            if dropped:
                del table.claims[wid]
            table.end_release_locked(wid)
        _log.debug(
            "folded release of workflow %r at epoch %d %s",
            wid,
            preparation.epoch,
            "committed" if committed else "did not commit; the claim stays tracked",
        )

    def forget(self, wid: str, expected_epoch: int | None) -> None:
        """See :meth:`ClaimRegistry.forget_local_claim
        <weft_sync.claims.registry.ClaimRegistry.forget_local_claim>`.
        """
        table = self._table
        with table.lock:
            entry = table.claims.get(wid)
            if entry is not None and (expected_epoch is None or entry.epoch == expected_epoch):
                del table.claims[wid]
            else:
                entry = None
        if entry is not None:
            _log.debug("forgot the local claim on workflow %r at epoch %d", wid, entry.epoch)

    # -- every claim -----------------------------------------------------------------------

    def give_back(self, wid: str, epoch_bytes: bytes, holder_bytes: bytes) -> None:
        """Delete a holder written after the registry's final release began (best effort).

        Conditioned on the exact epoch and holder bytes written, so nothing newer is touched.
        """
        fragment = _release_fragment(wid, epoch_bytes, holder_bytes)
        try:
            storage_conditional_batch(self._storage, fragment.conditions, fragment.operations)
        except Exception:
            _log.warning(
                "could not release the claim on workflow %r made after close()", wid, exc_info=True
            )

    def release_all(self, ids: Sequence[str], deadline: float | None = None) -> list[str]:
        """Release ``ids`` concurrently; swallow every failure, and log one warning for them.

        A claim whose release fails is forgotten here all the same: its holder is left to
        expire in the store, where another engine takes it over after the claim TTL.

        :param deadline: a ``time.monotonic()`` reading past which a release waits for a
            renewal of its claim in flight no longer than ``_IN_FLIGHT_GRACE_S``.
        :returns: the ids not released because of an error or the deadline.
        """
        if not ids:
            return []
        failures = _run_concurrently(
            lambda wid: self._release_quietly(wid, deadline), ids, RELEASE_ALL_CONCURRENCY
        )
        if failures:
            _log.warning(
                "could not release %d of %d claims (%s); they are forgotten here and their "
                "holders expire in the store, where another engine can take them over",
                len(failures),
                len(ids),
                failures[0][1],
            )
        return [wid for wid, _reason in failures]

    def _release_quietly(self, wid: str, deadline: float | None) -> str | None:
        """Release ``wid``; return why it failed, or ``None``."""
        try:
            self.release(wid, None, deadline)
        except Exception as exc:
            _log.debug("could not release the claim on workflow %r", wid, exc_info=True)
            return (
                str(exc) if isinstance(exc, _RenewalOutlasted) else f"{type(exc).__name__}: {exc}"
            )
        return None


def _release_fragment(wid: str, epoch_bytes: bytes, holder_bytes: bytes) -> Fragment:
    """The release transition plus the delete of this holder's by-engine entry."""
    fragment = build_release_transition(
        workflow_id=wid, current_epoch_bytes=epoch_bytes, current_holder_bytes=holder_bytes
    )
    return with_release_entry(fragment, wid, holder_bytes)


def _wait_for(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), _IN_FLIGHT_GRACE_S)


def _run_concurrently(
    fn: Callable[[_T], str | None], items: Sequence[_T], max_workers: int
) -> list[tuple[_T, str]]:
    """Call ``fn`` on every item from up to ``max_workers`` named daemon threads; join them all.

    ``fn`` must not raise (exceptions would end that worker early and be printed by threading).

    :returns: each item for which ``fn`` returned a reason, with it, in the order of ``items``.
    """
    results: list[str | None] = [None] * len(items)
    if len(items) == 1:
        results[0] = fn(items[0])
    else:
        _run_workers(fn, items, results, max_workers)
    return [
        (item, reason) for item, reason in zip(items, results, strict=True) if reason is not None
    ]


def _run_workers(
    fn: Callable[[_T], str | None],
    items: Sequence[_T],
    results: list[str | None],
    max_workers: int,
) -> None:
    # lock guards position; each worker writes only the result slots of the indexes it took.
    lock = threading.Lock()
    position = iter(range(len(items)))

    def worker() -> None:
        while True:
            with lock:
                index = next(position, None)
            if index is None:
                return
            results[index] = fn(items[index])

    threads = [
        threading.Thread(target=worker, name=f"weft-sync-release-{n}", daemon=True)
        for n in range(min(max_workers, len(items)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
