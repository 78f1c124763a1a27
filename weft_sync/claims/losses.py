"""Claims this engine gives up locally, and why.

A claim is lost locally when this engine can no longer vouch for it: no renewal succeeded within
the local renew deadline (``claim_ttl - claim_renew_interval`` after the start of the last
successful write of its holder), the store was replaced under the engine, or the store went back
in time (:mod:`~weft_sync.claims.rollback`). Such a claim is
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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from ..errors import StoreIdentityError, WorkflowClaimLostWarning
from ..metrics import ClaimLossCause, ClaimMetrics
from .tracking import ClaimTable, TrackedClaim

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

DEPOSED: Final[ClaimLossCause] = "deposed"
DEADLINE: Final[ClaimLossCause] = "deadline"
STORE_IDENTITY: Final[ClaimLossCause] = "store_identity"
STORE_ROLLBACK: Final[ClaimLossCause] = "store_rollback"


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
        # _store_lock guards _store_lost and _rollbacks only.
        self._store_lock = threading.Lock()
        self._store_lost: StoreIdentityError | None = None
        self._rollbacks = 0
        # _recent_lock guards _recent: the causes of the claims lost last, newest last.
        self._recent_lock = threading.Lock()
        self._recent: OrderedDict[str, ClaimLossCause] = OrderedDict()

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

    def lose_rolled_back(
        self, found_in: Sequence[str], store: str, evidence: str, now: int
    ) -> tuple[list[str], dict[str, Exception]]:
        """The store went back in time: report ``found_in`` and lose every other claim too.

        ``found_in`` are the claims whose failed write showed it (already dropped from the
        table); the rest of the table is dropped here. All are reported with cause
        ``store_rollback``; the first rollback this engine sees is logged as a warning naming
        the store, later ones at info level.

        :returns: every id reported, and what the warn sink raised, per id.
        """
        with self._store_lock:
            self._rollbacks += 1
            first = self._rollbacks == 1
        dropped = [wid for wid in self.drop_all(now) if wid not in found_in]
        _log.log(
            logging.WARNING if first else logging.INFO,
            "engine %s found that the store %s went back in time (%s): it lost writes this "
            "engine had made there, so every claim the engine held on it (%d) is treated as "
            "lost; writes of any owner whose epoch the store forgot are refused by the token "
            "fence",
            self._engine_id,
            store,
            evidence,
            len(found_in) + len(dropped),
        )
        lost = [*found_in, *dropped]
        return lost, self.report(lost, STORE_ROLLBACK)

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
        self._recent_lock = threading.Lock()
        self._recent = OrderedDict()

    def remember(self, ids: Iterable[str], cause: ClaimLossCause) -> None:
        """Remember why ``ids`` were lost, for :meth:`cause_of` (the last few thousand)."""
        with self._recent_lock:
            recent = self._recent
            for wid in ids:
                recent.pop(wid, None)
                recent[wid] = cause
            while len(recent) > _RECENT_LIMIT:
                recent.popitem(last=False)

    def cause_of(self, workflow_id: str) -> ClaimLossCause | None:
        """Why ``workflow_id`` was last lost here, if it was among the recent losses."""
        with self._recent_lock:
            return self._recent.get(workflow_id)

    def report(self, ids: Sequence[str], cause: ClaimLossCause) -> dict[str, Exception]:
        """Log, warn and count each lost claim; return what the sink raised, per id."""
        if not ids:
            return {}
        self.remember(ids, cause)
        if self._metrics is not None:
            self._metrics.record_claims_lost(cause, len(ids))
        sink_errors: dict[str, Exception] = {}
        interrupted: BaseException | None = None
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
            except BaseException as exc:
                # Host code behind the sink (SystemExit, ...): the other losses are reported
                # first, since their claims have already left the table.
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        return sink_errors


_RECENT_LIMIT: Final = 4096
"""How many lost claims' causes are remembered (for the error a later fenced write raises)."""

_EXPLANATIONS: Final[dict[str, str]] = {
    DEADLINE: (
        "no renewal succeeded for {deadline} ms, so its holder record may expire in the store "
        "before this engine can confirm it; stop side effects for it"
    ),
    STORE_IDENTITY: "the store it was made in is no longer the one at its location",
    DEPOSED: "another writer replaced it",
    STORE_ROLLBACK: "the store went back to an older state and forgot writes made for it",
}
