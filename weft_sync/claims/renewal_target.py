"""Adapts a :class:`~weft_sync.claims.registry.ClaimRegistry` to the renewal task's target.

The renewal task only knows "renewed" and "failed". ``renewed`` and ``not-held`` (a benign race
with this engine's own release) are successes; ``lost`` becomes a raised
:class:`ClaimRenewalLostError` and, when another writer deposed the claim (not when it was given
up locally at its renew deadline), counts one ``deposed`` attempt. The registry has already emitted
the claim-lost warning, so the adapter does not emit another; when the warning sink raised that
warning (warnings turned into errors), the renewal is still reported as lost.

With metrics, each batch's latency is observed, and the target keeps the smallest expiry among
the claims of the pass in progress (a renewed claim expires no earlier than the batch's clock
reading plus the TTL; one that failed keeps the expiry last confirmed), which
:meth:`RegistryRenewalTarget.finish_pass` turns into the expiry-margin gauge.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from ..errors import WorkflowClaimLostError, WorkflowClaimLostWarning
from ..metrics import ClaimMetrics
from .registry import DEFAULT_RENEW_CHUNK_SIZE, ClaimRegistry
from .results import RenewResult, RenewStatus

_RENEWED: Final = RenewStatus.RENEWED


class ClaimRenewalLostError(WorkflowClaimLostError):
    """A renewal found that another writer had replaced this engine's claim.

    :param workflow_id: the workflow whose claim was lost.
    """

    def __init__(self, workflow_id: str, cause: str | None = None) -> None:
        super().__init__(workflow_id)
        self.cause = cause
        if cause == "deadline":
            why = (
                "no renewal succeeded within the local renew deadline, so this engine gave it "
                "up before the store could expire it"
            )
        elif cause == "store_rollback":
            why = "the store went back in time and forgot writes made for this claim"
        else:
            why = "another engine or an external cancel/timeout/suspend/purge now owns its epoch"
        self.args = (
            f'workflow "{workflow_id}" lost its ownership claim during renewal; {why}, so this '
            f"engine must stop driving it",
        )


class RegistryRenewalTarget:
    """The renewal target over one registry, counting lost renewals as ``deposed``.

    :param registry: the registry whose claims are renewed.
    :param metrics: where ``deposed`` attempts are counted (optional).
    :param before_renewals: called (it must not raise) at the start of each renewal pass, when
        the held ids are listed, e.g. :meth:`~weft_sync.claims.store_clock.StoreClock.refresh`.
    """

    def __init__(
        self,
        registry: ClaimRegistry,
        metrics: ClaimMetrics | None = None,
        before_renewals: Callable[[], object] | None = None,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._before_renewals = before_renewals
        # _lock guards _pass_min_expiry, which batches running on several threads lower.
        self._lock = threading.Lock()
        self._pass_min_expiry: int | None = None

    def list_held_workflow_ids(self) -> list[str]:
        """The ids the registry currently holds (a snapshot); read once per renewal pass.

        Calls ``before_renewals`` first, so it runs once per pass even when nothing is held.
        """
        if self._before_renewals is not None:
            self._before_renewals()
        return self._registry.list_held_workflow_ids()

    def renew_workflow_claim(self, workflow_id: str) -> None:
        """Renew one claim.

        :raises ClaimRenewalLostError: the claim was lost.
        :raises StorageError: the commit failed (the claim is still held).
        """
        try:
            result = self._registry.renew(workflow_id)
        except WorkflowClaimLostWarning as warning:
            raise self._lost(workflow_id) from warning
        if result.status is RenewStatus.LOST:
            raise self._lost(workflow_id, result.cause)

    def renew_workflow_claims(
        self, workflow_ids: Sequence[str], *, chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE
    ) -> list[Exception | None]:
        """Renew many claims in a few transactions; return each id's error (``None``: success).

        Positional; a repeated id shares one outcome (and counts one ``deposed`` if lost).
        """
        registry, metrics = self._registry, self._metrics
        renewed_floor = registry.clock() + registry.claim_ttl_ms if metrics is not None else 0
        started = time.perf_counter()
        outcomes = registry.renew_many_outcomes(workflow_ids, chunk_size=chunk_size)
        if metrics is not None:
            metrics.observe_renewal_batch(time.perf_counter() - started)
        errors: list[Exception | None] = []
        # The error of each id that was not renewed, made once (a lost one counts once).
        failed: dict[str, Exception | None] = {}
        renewed_any = False
        for workflow_id, outcome in zip(workflow_ids, outcomes, strict=True):
            if type(outcome) is RenewResult and outcome.status is _RENEWED:
                errors.append(None)
                renewed_any = True
                continue
            if workflow_id not in failed:
                failed[workflow_id] = self._error_for(workflow_id, outcome)
            errors.append(failed[workflow_id])
        if metrics is not None and workflow_ids:
            self._lower_min_expiry(renewed_floor if renewed_any else None, list(failed))
        return errors

    def _lower_min_expiry(self, renewed_floor: int | None, failed: list[str]) -> None:
        """Fold this batch into the pass's smallest expiry (outside the registry's lock)."""
        candidates = [] if renewed_floor is None else [renewed_floor]
        for workflow_id in failed:
            expires_at = self._registry.tracked_expires_at(workflow_id)
            if expires_at is not None:  # a lost claim is no longer held: it has no margin
                candidates.append(expires_at)
        if not candidates:
            return
        lowest = min(candidates)
        with self._lock:
            if self._pass_min_expiry is None or lowest < self._pass_min_expiry:
                self._pass_min_expiry = lowest

    def finish_pass(self) -> None:
        """Set the expiry-margin gauge from the pass that just ended, and start a new one.

        The margin is read on the registry's clock, the one expiries are written on. The gauge
        becomes ``None`` when the pass renewed nothing (no claim held).
        """
        with self._lock:
            lowest, self._pass_min_expiry = self._pass_min_expiry, None
        if self._metrics is not None:
            now = self._registry.clock()
            self._metrics.set_expiry_margin(None if lowest is None else (lowest - now) / 1000)

    def _error_for(self, workflow_id: str, outcome: RenewResult | Exception) -> Exception | None:
        if isinstance(outcome, WorkflowClaimLostWarning):
            lost = self._lost(workflow_id)
            lost.__cause__ = outcome
            return lost
        if isinstance(outcome, Exception):
            return outcome
        if outcome.status is RenewStatus.LOST:
            return self._lost(workflow_id, outcome.cause)
        return None

    def _lost(self, workflow_id: str, cause: str | None = None) -> ClaimRenewalLostError:
        if self._metrics is not None and cause is None:
            self._metrics.record_claim_attempt("deposed")
        return ClaimRenewalLostError(workflow_id, cause)


def create_renewal_target(
    registry: ClaimRegistry,
    metrics: ClaimMetrics | None = None,
    before_renewals: Callable[[], object] | None = None,
) -> RegistryRenewalTarget:
    """Build the renewal task's target over ``registry`` (see :class:`RegistryRenewalTarget`)."""
    return RegistryRenewalTarget(registry, metrics, before_renewals)
