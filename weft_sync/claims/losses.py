"""Claims this engine gives up locally, and why.

A claim is lost locally when this engine can no longer vouch for it: no renewal succeeded within
the local renew deadline (``claim_ttl - claim_renew_interval`` after the start of the last
successful write of its holder), or the store was replaced under the engine. Such a claim is
dropped from the registry's table, so it is not renewed again and every fenced write for it
fails closed at the fence; its takeover cooldown starts; and it is reported once: one log
record, one :class:`~weft_sync.errors.WorkflowClaimLostWarning` carrying the cause through the
registry's warn sink, and one count in :class:`~weft_sync.metrics.ClaimMetrics`. Nothing is
written to the store: the holder record there expires on its own, or the store is no longer the
one the claims were made in.

Threading: entries are collected and dropped under the table's lock; logging, the warn sink and
the metrics run after it is released.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from ..errors import StoreIdentityError, WorkflowClaimLostWarning
from ..metrics import ClaimLossCause, ClaimMetrics
from .tracking import ClaimTable, TrackedClaim

__all__ = ["DEADLINE", "DEPOSED", "STORE_IDENTITY", "LocalLosses"]

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

DEPOSED: Final[ClaimLossCause] = "deposed"
DEADLINE: Final[ClaimLossCause] = "deadline"
STORE_IDENTITY: Final[ClaimLossCause] = "store_identity"


class LocalLosses:
    """Drops claims from a registry's table with a cause and reports each one.

    :param table: the registry's tracking state.
    :param warn: the registry's warn sink.
    :param engine_id: this engine's id, for log messages.
    :param deadline_ms: the local renew deadline, counted from ``TrackedClaim.renewed_at``.
    :param metrics: counts each lost claim by cause (optional).
    """

    def __init__(
        self,
        table: ClaimTable,
        warn: Callable[[Warning], None],
        engine_id: str,
        deadline_ms: int,
        metrics: ClaimMetrics | None,
    ) -> None:
        self._table = table
        self._warn = warn
        self._engine_id = engine_id
        self._deadline_ms = deadline_ms
        self._metrics = metrics
        # _store_lock guards _store_lost only.
        self._store_lock = threading.Lock()
        self._store_lost: StoreIdentityError | None = None

    @property
    def deadline_ms(self) -> int:
        """How long a claim may go without a successful renewal before it is lost locally."""
        return self._deadline_ms

    @property
    def metrics(self) -> ClaimMetrics | None:
        """Where lost claims are counted, if anywhere."""
        return self._metrics

    def drop_overdue(self, members: Iterable[tuple[str, TrackedClaim]], now: int) -> list[str]:
        """Drop each ``(id, entry)`` still tracked as ``entry`` and past its deadline at ``now``.

        :returns: the ids dropped; report them with :meth:`report`.
        """
        dropped: list[str] = []
        table = self._table
        with table.lock:
            claims = table.claims
            for wid, entry in members:
                if now - entry.renewed_at >= self._deadline_ms and claims.get(wid) is entry:
                    del claims[wid]
                    table.cooldown.record_deposition(wid, now)
                    dropped.append(wid)
        return dropped

    def lose_overdue(self, wid: str, entry: TrackedClaim, now: int) -> None:
        """Drop and report ``entry`` if still tracked and past its deadline. Never raises."""
        for lost, exc in self.report(self.drop_overdue([(wid, entry)], now), DEADLINE).items():
            _log.warning("the warn sink raised reporting workflow %r lost: %r", lost, exc)

    def drop_all(self, now: int) -> list[str]:
        """Drop every tracked claim; return their ids (report them with :meth:`report`)."""
        table = self._table
        with table.lock:
            dropped = list(table.claims)
            table.claims.clear()
            for wid in dropped:
                table.cooldown.record_deposition(wid, now)
        return dropped

    def lose_all(self, cause: ClaimLossCause, now: int) -> list[str]:
        """Drop and report every tracked claim; log what the warn sink raised. Never raises."""
        dropped = self.drop_all(now)
        for wid, exc in self.report(dropped, cause).items():
            _log.warning("the warn sink raised reporting workflow %r lost: %r", wid, exc)
        return dropped

    def lose_store(self, error: StoreIdentityError, now: int) -> None:
        """Remember that the store was replaced, log it once, and lose every claim."""
        with self._store_lock:
            first = self._store_lost is None
            if first:
                self._store_lost = error
        if first:
            _log.error(
                "engine %s stops using the store at %s: %s; every claim it held there is "
                "treated as lost and no further claim writes are made to it",
                self._engine_id,
                error.location,
                error.detail,
            )
        self.lose_all(STORE_IDENTITY, now)

    def refuse_lost_store(self) -> None:
        """Raise the remembered :class:`~weft_sync.errors.StoreIdentityError`, if any."""
        with self._store_lock:
            error = self._store_lost
        if error is not None:
            raise error

    def reset(self) -> None:
        """Forget a replaced store (a forked child: a parent thread may have held the lock)."""
        self._store_lock = threading.Lock()
        self._store_lost = None

    def report(self, ids: Sequence[str], cause: ClaimLossCause) -> dict[str, Exception]:
        """Log, warn and count each lost claim; return what the sink raised, per id."""
        if not ids:
            return {}
        if self._metrics is not None:
            self._metrics.record_claims_lost(cause, len(ids))
        sink_errors: dict[str, Exception] = {}
        for wid in ids:
            _log.warning(
                "engine %s lost its claim on workflow %r locally (%s): %s",
                self._engine_id,
                wid,
                cause,
                _EXPLANATIONS[cause].format(deadline=self._deadline_ms),
            )
            try:
                self._warn(WorkflowClaimLostWarning(wid, cause))
            except Exception as exc:
                sink_errors[wid] = exc
        return sink_errors


_EXPLANATIONS: Final[dict[str, str]] = {
    DEADLINE: (
        "no renewal succeeded for {deadline} ms, so its holder record may expire in the store "
        "before this engine can confirm it; stop side effects for it"
    ),
    STORE_IDENTITY: "the store it was made in is no longer the one at its location",
    DEPOSED: "another writer replaced it",
}
