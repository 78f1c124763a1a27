"""The reclaim target: takes over claims stranded by dead engines and drives the workflows.

A successful takeover or ownerless acquire is re-checked against a fresh read of the workflow
record (still running, still eligible) before ``on_reclaimed`` drives it; a drive that raises keeps
the claim and is retried on later passes, never released, since the workflow may already have
started locally. A claim this engine already holds is driven again only as such a retry (or after
the confirming read failed), and by one attempt at a time: a candidate listed before this
engine's host claimed it, or listed by two overlapping passes, is not driven twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from .. import keys
from ..claims.registry import ClaimRegistry
from ..claims.transitions import is_claim_expired
from ..codec import WorkflowRecord, decode_holder, try_decode_workflow_record
from ..metrics import ClaimMetrics
from ..storage.base import Storage
from .reclaim_scan import list_reclaim_candidates
from .targets import TAKEOVER_MAX_ATTEMPTS, ReclaimAttemptResult

__all__ = ["EligibilityPredicate", "ReclaimTargetHandle", "create_reclaim_target"]

_log = logging.getLogger(__name__)

EligibilityPredicate = Callable[[str, "str | None"], bool]
"""``(workflow type, pinned revision or None) -> bool``: can this engine run it?"""

_RECLAIMED: Final = ReclaimAttemptResult.RECLAIMED
_NOT_ELIGIBLE: Final = ReclaimAttemptResult.NOT_ELIGIBLE
_BACKOFF: Final = ReclaimAttemptResult.BACKOFF_SKIPPED
_LOST_RACE: Final = ReclaimAttemptResult.LOST_RACE


class ReclaimTargetHandle:
    """A :class:`~weft_sync.maintenance.targets.ReclaimTarget` over a registry and its store.

    :param registry: this engine's claim registry.
    :param storage: the store the registry writes to (read for workflow records).
    :param metrics: receives ``takeover``, ``acquired``, ``lost_race`` and ``backoff_skipped``.
    :param on_reclaimed: drives (resumes) a reclaimed workflow; raising keeps it for a redrive.
    :param is_eligible: ``(type, revision) -> bool``; ineligible workflows are never claimed.
    :param skip_live_holders: leave out of discovery the workflows whose holder the scan read as
        unexpired, instead of attempting (and reading) each one. Saves two reads per foreign
        live claim per pass on large fleets; off by default, so that every held workflow is
        attempted and a recently deposed claim reports ``backoff-skipped`` as specified.
    """

    def __init__(
        self,
        registry: ClaimRegistry,
        storage: Storage,
        metrics: ClaimMetrics,
        on_reclaimed: Callable[[str], object] | None = None,
        is_eligible: EligibilityPredicate | None = None,
        *,
        skip_live_holders: bool = False,
    ) -> None:
        self._registry = registry
        self._skip_live_holders = skip_live_holders
        self._storage = storage
        self._metrics = metrics
        self._on_reclaimed = on_reclaimed
        self._is_eligible = is_eligible
        # _lock guards _pending_redrive and _disposing.
        self._lock = threading.Lock()
        self._pending_redrive: dict[str, int] = {}
        self._disposing = False

    @property
    def disposing(self) -> bool:
        """Whether :meth:`mark_disposing` was called."""
        return self._is_disposing()

    def _is_disposing(self) -> bool:
        # A method rather than the property inside the class: disposal can begin during any
        # blocking call, so each check must be a fresh read.
        with self._lock:
            return self._disposing

    def mark_disposing(self) -> None:
        """Stop claiming for good: attempts return ``not-eligible``, late claims are released."""
        with self._lock:
            self._disposing = True

    def pending_redrive_ids(self) -> list[str]:
        """Ids held by this engine whose last drive failed and will be retried."""
        with self._lock:
            return list(self._pending_redrive)

    def list_reclaim_candidate_workflow_ids(self) -> list[str]:
        """Discovered candidates (minus our own claims), then pending redrives, de-duplicated."""
        if self._is_disposing():
            return []
        held = self._registry.list_held_workflow_ids()
        found = list_reclaim_candidates(
            self._storage,
            held,
            holder_is_live=self._holder_is_live if self._skip_live_holders else None,
        )
        ids = dict.fromkeys(found)
        ids.update(dict.fromkeys(self.pending_redrive_ids()))
        return list(ids)

    def attempt_workflow_claim_takeover(self, workflow_id: str) -> ReclaimAttemptResult:
        """Reclaim one candidate: redrive our own failed drive, or take over / acquire and drive.

        A claim this engine holds is driven again only when its last drive failed under the
        same epoch, and by one attempt at a time.
        """
        if self._is_disposing():
            return _NOT_ELIGIBLE
        current = self._registry.current_epoch(workflow_id)
        if current is None:
            self._drop_pending(workflow_id)
            return self._takeover_loop(workflow_id)
        with self._lock:
            # Taking the entry makes this attempt the only one redriving it; a failed drive
            # puts it back.
            pending = self._pending_redrive.pop(workflow_id, None)
        if pending is None:
            # Held here with no failed drive to retry: whoever claimed it (the host, or another
            # attempt that is driving it right now) drives it. Driving it again would run the
            # workflow twice on this engine.
            return _NOT_ELIGIBLE
        if pending != current:
            # The failed drive ran under an older generation; the takeover loop judges afresh.
            return self._takeover_loop(workflow_id)
        return self._redrive(workflow_id, current)

    # -- steps ----------------------------------------------------------------------------------

    def _redrive(self, workflow_id: str, epoch: int) -> ReclaimAttemptResult:
        """Retry the failed drive of a claim held at ``epoch``; the caller took its entry.

        The entry is put back when the drive is skipped while the workflow may still be running
        (disposal, a failed read): a claim held here is never left undriven with no retry.
        """
        try:
            disposing = self._is_disposing()
            running = not disposing and self._is_still_running(workflow_id)
        except BaseException:
            self._keep_pending(workflow_id, epoch)
            raise
        if not disposing and not running:
            self._release_if_epoch(workflow_id, epoch)
            return _NOT_ELIGIBLE
        if disposing or self._is_disposing():
            self._keep_pending(workflow_id, epoch)
            return _NOT_ELIGIBLE
        return self._drive(workflow_id, epoch)

    def _takeover_loop(self, workflow_id: str) -> ReclaimAttemptResult:
        if self._is_eligible is not None and not self._check_eligible(
            self._read_record(workflow_id)
        ):
            return _NOT_ELIGIBLE
        for _ in range(TAKEOVER_MAX_ATTEMPTS):
            if self._is_disposing():
                return _NOT_ELIGIBLE
            result = self._registry.takeover(workflow_id)
            status = result.status
            if status == "acquired":
                self._metrics.record_claim_attempt("takeover")
                assert result.epoch is not None
                return self._after_claim(workflow_id, result.epoch)
            if status == "backoff-skipped":
                self._metrics.record_claim_attempt("backoff_skipped")
                return _BACKOFF
            if status == "not-expired":
                return _NOT_ELIGIBLE
            if status == "no-claim":
                outcome = self._ownerless_acquire(workflow_id)
                if outcome is not None:
                    return outcome
                continue
            self._metrics.record_claim_attempt("lost_race")
        return _LOST_RACE

    def _ownerless_acquire(self, workflow_id: str) -> ReclaimAttemptResult | None:
        """Acquire a running workflow nobody holds; ``None`` means a lost race (retry)."""
        if self._is_disposing() or not self._is_still_running(workflow_id) or self._is_disposing():
            return _NOT_ELIGIBLE
        result = self._registry.acquire(workflow_id)
        if result.status != "acquired":
            self._metrics.record_claim_attempt("lost_race")
            return None
        self._metrics.record_claim_attempt("acquired")
        assert result.epoch is not None
        return self._after_claim(workflow_id, result.epoch)

    def _after_claim(self, workflow_id: str, epoch: int) -> ReclaimAttemptResult:
        if self._is_disposing():
            self._release_if_epoch(workflow_id, epoch)
            return _NOT_ELIGIBLE
        try:
            confirmed = self._confirm_still_running_or_release(workflow_id, epoch)
        except BaseException:
            # The claim is held but its workflow unread: retry it as a redrive on a later pass.
            self._keep_pending(workflow_id, epoch)
            raise
        if not confirmed:
            return _NOT_ELIGIBLE
        if self._is_disposing():
            self._release_if_epoch(workflow_id, epoch)
            return _NOT_ELIGIBLE
        _log.info("reclaimed workflow %r at epoch %d", workflow_id, epoch)
        return self._drive(workflow_id, epoch)

    def _drive(self, workflow_id: str, epoch: int) -> ReclaimAttemptResult:
        if self._on_reclaimed is None:
            self._drop_pending(workflow_id)
            return _RECLAIMED
        try:
            self._on_reclaimed(workflow_id)
        except BaseException:
            self._keep_pending(workflow_id, epoch)
            raise
        self._drop_pending(workflow_id)
        return _RECLAIMED

    # -- helpers --------------------------------------------------------------------------------

    def _holder_is_live(self, holder_bytes: bytes) -> bool:
        # A holder the scan saw unexpired would only come back not-expired from the takeover;
        # an undecodable one is never live (it is stolen at once).
        holder = decode_holder(holder_bytes)
        if holder is None:
            return False
        return not is_claim_expired(
            expires_at=holder.expires_at,
            now=self._registry.clock(),
            renew_interval_ms=self._registry.claim_renew_interval_ms,
        )

    def _read_record(self, workflow_id: str) -> WorkflowRecord | None:
        return try_decode_workflow_record(self._storage.get(keys.workflow(workflow_id)))

    def _is_still_running(self, workflow_id: str) -> bool:
        record = self._read_record(workflow_id)
        return record is not None and record.status == "running"

    def _check_eligible(self, record: WorkflowRecord | None) -> bool:
        if self._is_eligible is None:
            return True
        if record is None:
            return False
        return bool(self._is_eligible(record.type, record.revision))

    def _confirm_still_running_or_release(self, workflow_id: str, epoch: int) -> bool:
        record = self._read_record(workflow_id)
        ok = record is not None and record.status == "running" and self._check_eligible(record)
        if not ok:
            self._release_if_epoch(workflow_id, epoch)
        return ok

    def _release_if_epoch(self, workflow_id: str, epoch: int) -> None:
        # Release only the generation this attempt claimed: a concurrent start-new may already
        # hold a newer epoch for the same id.
        if self._registry.current_epoch(workflow_id) == epoch:
            self._registry.release(workflow_id, expected_epoch=epoch)

    def _keep_pending(self, workflow_id: str, epoch: int) -> None:
        with self._lock:
            self._pending_redrive[workflow_id] = epoch

    def _drop_pending(self, workflow_id: str) -> None:
        with self._lock:
            self._pending_redrive.pop(workflow_id, None)


def create_reclaim_target(
    registry: ClaimRegistry,
    storage: Storage,
    metrics: ClaimMetrics,
    on_reclaimed: Callable[[str], object] | None = None,
    is_eligible: EligibilityPredicate | None = None,
    *,
    skip_live_holders: bool = False,
) -> ReclaimTargetHandle:
    """Build the reclaim target of one engine (see :class:`ReclaimTargetHandle`)."""
    return ReclaimTargetHandle(
        registry,
        storage,
        metrics,
        on_reclaimed,
        is_eligible,
        skip_live_holders=skip_live_holders,
    )
