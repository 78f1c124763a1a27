"""The reclaim target: takes over claims stranded by dead engines and drives the workflows.

A successful takeover or ownerless acquire is re-checked against a fresh read of the workflow
record (still running, still eligible) before ``on_reclaimed`` drives it; a drive that raises keeps
the claim and is retried on later passes, never released, since the workflow may already have
started locally. A claim this engine already holds is driven again only as such a retry (or after
the confirming read failed), and by one attempt at a time: a candidate listed before this
engine's host claimed it, or listed by two overlapping passes, is not driven twice.

The target is also a :class:`~.targets.BatchReclaimTarget`: the first takeover attempt of many
candidates is made with one read and one commit per chunk
(:meth:`ClaimRegistry.takeover_many <weft_sync.claims.registry.ClaimRegistry.takeover_many>`);
each candidate is then finished (retries, the re-check of its record, the drive) exactly as a
single attempt would finish it. The records of a chunk's won claims are re-checked with one
``get_many`` right after its commit, and each completion drives with the record that read
returned (a single attempt, a retry, or a chunk whose read failed re-checks with a ``get`` at
completion). Either way the record is read after the claim was won, and a claim is driven only
while this engine still holds it at the epoch it won. A change to the record after that read is
not seen by the drive, as with any read: the former holder cannot make one (its writes are
fenced by the takeover), and an external rotation (cancel, timeout) replaces the claim, so the
handler's fenced writes are refused.

With ``fair_share`` (the ``Ownership`` facade turns it on) a pass attempts only this engine's
fair share of the stranded candidates, in an order of its own (:mod:`.fair_share`,
:mod:`.reclaim_selection`); with ``max_claims`` it never takes over beyond that many held
claims.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from .. import keys
from ..claims.registry import ClaimRegistry
from ..claims.results import TakeoverResult
from ..claims.transitions import is_claim_expired
from ..codec import WorkflowRecord, decode_holder, try_decode_workflow_record
from ..metrics import ClaimMetrics
from ..storage.base import Storage
from ..storage.reads import storage_get_many
from .attempts import TAKEOVER_MAX_ATTEMPTS, ReclaimAttemptResult
from .discoveries import Discovery, ScanDiscovery
from .fair_share import validate_max_claims
from .scan import list_reclaim_candidates
from .selection import CandidateSelection

_log = logging.getLogger(__name__)

EligibilityPredicate = Callable[[str, "str | None"], bool]
"""``(workflow type, pinned revision or None) -> bool``: can this engine run it?"""

_RECLAIMED: Final = ReclaimAttemptResult.RECLAIMED
_NOT_ELIGIBLE: Final = ReclaimAttemptResult.NOT_ELIGIBLE
_BACKOFF: Final = ReclaimAttemptResult.BACKOFF_SKIPPED
_LOST_RACE: Final = ReclaimAttemptResult.LOST_RACE


@dataclass(eq=False, slots=True)
class ReclaimPlan:
    """One candidate as :meth:`ReclaimTargetHandle.prepare_workflow_claim_takeovers` left it.

    ``final`` is the attempt's result when preparing decided it (not eligible). ``first`` is the
    outcome of the first takeover attempt when preparing made it. A plan with neither is
    attempted in full by
    :meth:`~ReclaimTargetHandle.complete_workflow_claim_takeover`. ``confirmed`` says the
    record of a claim ``first`` won was read after the chunk's commit; ``record`` is what that
    read found (``None``: no record); both are set before the plan is returned and never
    change. ``completed`` is set (under the target's lock) when a
    completion starts: a plan is completed at most once, so a claim it won is driven at most
    once.
    """

    workflow_id: str
    first: TakeoverResult | None = None
    final: ReclaimAttemptResult | None = None
    completed: bool = False
    confirmed: bool = False
    record: WorkflowRecord | None = None


class ReclaimTargetHandle:
    """A :class:`~weft_sync.maintenance.targets.ReclaimTarget` over a registry and its store.

    :param registry: this engine's claim registry.
    :param storage: the store the registry writes to (read for workflow records).
    :param metrics: receives ``takeover``, ``acquired``, ``lost_race`` and ``backoff_skipped``.
    :param on_reclaimed: drives (resumes) a reclaimed workflow; raising keeps it for a redrive.
    :param drive_record: like ``on_reclaimed``, given the record the re-check just read as well
        (used instead of it when set, so the drive need not read the record again).
    :param discovery: how candidates are found (default: the full scans of :mod:`.reclaim_scan`).
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
        max_claims: int | None = None,
        fair_share: bool = False,
        discovery: Discovery | None = None,
        drive_record: Callable[[str, WorkflowRecord], object] | None = None,
    ) -> None:
        self._drive_record = drive_record
        self._discovery: Discovery = discovery or ScanDiscovery(
            storage, self._live_engine, skip_live=skip_live_holders
        )
        self._custom_discovery = discovery is not None
        self._max_claims = validate_max_claims(max_claims)
        self._fair_share = fair_share
        self._registry = registry
        self._skip_live_holders = skip_live_holders
        self._storage = storage
        self._metrics = metrics
        self._on_reclaimed = on_reclaimed
        self._is_eligible = is_eligible
        self._selection = CandidateSelection(
            registry, self._discovery, fair_share=fair_share, max_claims=self._max_claims
        )
        # _lock guards _pending_redrive, _disposing, _deferred and the completed flag of every
        # plan.
        self._lock = threading.Lock()
        self._deferred: Callable[[str], bool] | None = None
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

    def set_deferral(self, deferred: Callable[[str], bool] | None) -> None:
        """Skip (``backoff-skipped``) the candidates ``deferred(id)`` says are in a backoff.

        The driver tracker's redrive backoff: a workflow whose drive here ended unfinished is
        not claimed again by this engine until its backoff is over.
        """
        with self._lock:
            self._deferred = deferred

    def _is_deferred(self, workflow_id: str) -> bool:
        with self._lock:
            deferred = self._deferred
        return deferred is not None and deferred(workflow_id)

    def pending_redrive_ids(self) -> list[str]:
        """Ids held by this engine whose last drive failed and will be retried."""
        with self._lock:
            return list(self._pending_redrive)

    def list_reclaim_candidate_workflow_ids(self) -> list[str]:
        """Discovered candidates (minus our own claims), then pending redrives, de-duplicated."""
        if self._is_disposing():
            return []
        held = self._registry.list_held_workflow_ids()
        if self._fair_share or self._max_claims is not None or self._custom_discovery:
            found = self._selection.select(held)
        else:
            found = list_reclaim_candidates(
                self._storage,
                held,
                holder_is_live=self._holder_is_live if self._skip_live_holders else None,
            )
        ids = dict.fromkeys(found)
        ids.update(dict.fromkeys(self.pending_redrive_ids()))
        return list(ids)

    def dead_engines(self) -> Mapping[str, bytes]:
        """Engines the last discovery saw crashed or closed, with the record bytes judged."""
        return self._selection.dead_engines()

    def dead_work_left(self) -> bool:
        """Whether the last discovery saw claims of crashed or closed engines."""
        return self._selection.dead_work_left()

    def _capacity_left(self) -> int | None:
        return self._selection.capacity_left()

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
            if self._is_deferred(workflow_id):
                return _BACKOFF
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

    def prepare_workflow_claim_takeovers(self, workflow_ids: Sequence[str]) -> list[ReclaimPlan]:
        """Make the first takeover attempt of every candidate this engine does not hold.

        One ``get_many`` reads the workflow records when an eligibility predicate is set
        (ineligible candidates are decided here), one ``takeover_many`` makes the attempts, and
        one more ``get_many`` reads the records of the claims won, for the re-check at
        completion. A read or a chunk that fails leaves its candidates to be attempted in full by
        :meth:`complete_workflow_claim_takeover` (a failed re-check read: re-checked there), as
        do candidates held here, candidates whose eligibility check raised, and invalid ids.
        Every returned plan must be completed: it may stand for a claim already taken over.
        """
        plans = {wid: ReclaimPlan(wid) for wid in workflow_ids}
        if self._is_disposing():
            return [ReclaimPlan(wid) for wid in workflow_ids]
        fresh: list[str] = []
        for wid in plans:
            try:
                held = self._registry.current_epoch(wid) is not None
            except (TypeError, ValueError):
                continue  # the single attempt reports the invalid id
            if held:
                continue
            if self._is_deferred(wid):
                plans[wid] = ReclaimPlan(wid, final=_BACKOFF)
            else:
                fresh.append(wid)
        for wid in fresh:
            # Not held here, so no drive of ours can be pending (as in the single attempt).
            self._drop_pending(wid)
        eligible = self._eligible_or_decide(fresh, plans)
        capacity = self._capacity_left()
        if capacity is not None and len(eligible) > capacity:
            for wid in eligible[capacity:]:
                plans[wid] = ReclaimPlan(wid, final=_NOT_ELIGIBLE)
            eligible = eligible[:capacity]
        if eligible:
            self._first_attempts(eligible, plans)
        # A repeated id gets a plain plan after the first: attempted alone, it finds the claim
        # held here and leaves it to the first plan's completion.
        seen: set[str] = set()
        ordered: list[ReclaimPlan] = []
        for wid in workflow_ids:
            ordered.append(plans[wid] if wid not in seen else ReclaimPlan(wid))
            seen.add(wid)
        return ordered

    def complete_workflow_claim_takeover(self, plan: object) -> ReclaimAttemptResult:
        """Finish one prepared candidate as :meth:`attempt_workflow_claim_takeover` would."""
        if not isinstance(plan, ReclaimPlan):
            raise TypeError(
                f"complete_workflow_claim_takeover() takes a ReclaimPlan from "
                f"prepare_workflow_claim_takeovers(), got {type(plan).__name__} {plan!r:.80}"
            )
        with self._lock:
            if plan.completed:
                raise ValueError(
                    f"the reclaim plan of workflow {plan.workflow_id!r} was already completed; "
                    f"prepare the candidate again"
                )
            plan.completed = True
        if plan.final is not None:
            return plan.final
        if plan.first is None:
            return self.attempt_workflow_claim_takeover(plan.workflow_id)
        return self._takeover_loop(plan.workflow_id, plan.first, plan)

    def _eligible_or_decide(self, fresh: list[str], plans: dict[str, ReclaimPlan]) -> list[str]:
        """The candidates of ``fresh`` worth a takeover; ineligible ones get a final plan."""
        if self._is_eligible is None or not fresh:
            return fresh
        try:
            records = self._read_records(fresh)
        except Exception as exc:
            _log.debug("batched eligibility read failed (%r); attempting one by one", exc)
            return []
        eligible: list[str] = []
        for wid, record in zip(fresh, records, strict=True):
            try:
                ok = self._check_eligible(record)
            except Exception as exc:
                # Attempted alone, the candidate asks the predicate again and fails by itself.
                _log.debug("eligibility check of %r raised %r; attempting alone", wid, exc)
                continue
            self._selection.note_eligibility(wid, ok)
            if ok:
                eligible.append(wid)
            else:
                plans[wid] = ReclaimPlan(wid, final=_NOT_ELIGIBLE)
        return eligible

    def _first_attempts(self, eligible: list[str], plans: dict[str, ReclaimPlan]) -> None:
        """Attempt ``eligible`` in one ``takeover_many``; a failed id is attempted alone later."""
        outcomes = self._registry.takeover_many(eligible, dead_engines=self.dead_engines())
        for wid, outcome in zip(eligible, outcomes, strict=True):
            if isinstance(outcome, Exception):
                _log.debug("batched takeover of %r failed (%r); attempting alone", wid, outcome)
                continue
            plans[wid] = ReclaimPlan(wid, first=outcome)
        try:
            self._confirm_won([plans[wid] for wid in eligible])
        except BaseException:
            # SystemExit and the like from the store: the claims won are held and renewed here
            # but their plans are never returned, so each is retried as a redrive.
            for wid in eligible:
                first = plans[wid].first
                if first is not None and first.status == "acquired" and first.epoch is not None:
                    self._keep_pending(wid, first.epoch)
            raise

    def _confirm_won(self, plans: list[ReclaimPlan]) -> None:
        """Read the records of the claims ``plans`` won, in one ``get_many``, for the re-check.

        A failed read leaves the plans unconfirmed: their completions read the record alone (and
        keep the claim for a redrive if that fails too).
        """
        won = [plan for plan in plans if plan.first is not None and plan.first.status == "acquired"]
        if not won:
            return
        try:
            records = self._read_records([plan.workflow_id for plan in won])
        except Exception as exc:
            _log.debug(
                "re-check read of %d reclaimed workflows failed (%r); each is re-read alone",
                len(won),
                exc,
            )
            return
        for plan, record in zip(won, records, strict=True):
            plan.record = record
            plan.confirmed = True

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

    def _takeover_loop(
        self,
        workflow_id: str,
        first: TakeoverResult | None = None,
        plan: ReclaimPlan | None = None,
    ) -> ReclaimAttemptResult:
        """Take over (or acquire, if ownerless) with bounded retries, then re-check and drive.

        ``first`` is a first attempt already made (eligibility was checked before it), by
        ``plan`` when the record of a claim it won was read already.
        """
        if first is None and self._capacity_left() == 0:
            return _NOT_ELIGIBLE
        if first is None and self._is_eligible is not None:
            eligible = self._check_eligible(self._read_record(workflow_id))
            self._selection.note_eligibility(workflow_id, eligible)
            if not eligible:
                return _NOT_ELIGIBLE
        for attempt in range(TAKEOVER_MAX_ATTEMPTS):
            if attempt == 0 and first is not None:
                result = first
                if result.status != "acquired" and self._is_disposing():
                    return _NOT_ELIGIBLE
            else:
                if self._is_disposing():
                    return _NOT_ELIGIBLE
                result = self._registry.takeover(workflow_id, dead_engines=self.dead_engines())
            status = result.status
            if status == "acquired":
                assert result.epoch is not None
                try:
                    self._count_takeover(result)
                except BaseException:
                    # The host's clock raised, and the claim is held and renewed here already:
                    # retry its drive as a redrive on a later pass.
                    self._keep_pending(workflow_id, result.epoch)
                    raise
                read = plan if attempt == 0 and plan is not None and plan.confirmed else None
                return self._after_claim(workflow_id, result.epoch, read)
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

    def _count_takeover(self, result: TakeoverResult) -> None:
        self._metrics.record_claim_attempt("takeover")
        # A holder taken before its expiry (its engine known dead) has no delay.
        if result.expires_at is not None and not result.before_expiry:
            delay_ms = self._registry.clock() - result.expires_at
            self._metrics.observe_takeover_delay(delay_ms / 1000)

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

    def _after_claim(
        self, workflow_id: str, epoch: int, read: ReclaimPlan | None = None
    ) -> ReclaimAttemptResult:
        """Re-check a claim won at ``epoch`` against its record read since, then drive it.

        ``read`` is the confirmed plan whose record was read after the claim was won; without
        it the record is read now.
        """
        if self._is_disposing():
            self._release_if_epoch(workflow_id, epoch)
            return _NOT_ELIGIBLE
        try:
            record = self._confirm_still_running_or_release(workflow_id, epoch, read)
        except BaseException:
            # The claim is held but its workflow unread: retry it as a redrive on a later pass.
            self._keep_pending(workflow_id, epoch)
            raise
        if record is None:
            return _NOT_ELIGIBLE
        if self._is_disposing():
            self._release_if_epoch(workflow_id, epoch)
            return _NOT_ELIGIBLE
        if self._registry.current_epoch(workflow_id) != epoch:
            # Lost, or released and claimed anew by this engine's host since it was won:
            # whoever holds the newer claim drives that generation.
            _log.debug("reclaimed claim on %r at epoch %d is no longer held", workflow_id, epoch)
            return _NOT_ELIGIBLE
        _log.info("reclaimed workflow %r at epoch %d", workflow_id, epoch)
        return self._drive(workflow_id, epoch, record)

    def _drive(
        self, workflow_id: str, epoch: int, record: WorkflowRecord | None = None
    ) -> ReclaimAttemptResult:
        if self._on_reclaimed is None:
            self._drop_pending(workflow_id)
            return _RECLAIMED
        try:
            if record is not None and self._drive_record is not None:
                # The record just confirmed: the drive need not read it again.
                self._drive_record(workflow_id, record)
            else:
                self._on_reclaimed(workflow_id)
        except BaseException:
            self._keep_pending(workflow_id, epoch)
            raise
        self._drop_pending(workflow_id)
        return _RECLAIMED

    # -- helpers --------------------------------------------------------------------------------

    def _live_engine(self, holder_bytes: bytes) -> str | None:
        # The engine of a holder the scan saw unexpired; None for an expired or garbage one.
        holder = decode_holder(holder_bytes)
        if holder is None or not self._holder_is_live(holder_bytes):
            return None
        return holder.engine_id

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

    def _read_records(self, workflow_ids: list[str]) -> list[WorkflowRecord | None]:
        values = storage_get_many(self._storage, [keys.workflow(wid) for wid in workflow_ids])
        return [try_decode_workflow_record(value) for value in values]

    def _is_still_running(self, workflow_id: str) -> bool:
        record = self._read_record(workflow_id)
        return record is not None and record.status == "running"

    def _check_eligible(self, record: WorkflowRecord | None) -> bool:
        if self._is_eligible is None:
            return True
        if record is None:
            return False
        return bool(self._is_eligible(record.type, record.revision))

    def _confirm_still_running_or_release(
        self, workflow_id: str, epoch: int, read: ReclaimPlan | None = None
    ) -> WorkflowRecord | None:
        """The record if it is still running and eligible; else release the claim, ``None``.

        The record is ``read``'s when given (read after the claim was won), else read now.
        """
        record = read.record if read is not None else self._read_record(workflow_id)
        if record is not None and record.status == "running" and self._check_eligible(record):
            return record
        self._release_if_epoch(workflow_id, epoch)
        return None

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
    max_claims: int | None = None,
    fair_share: bool = False,
    discovery: Discovery | None = None,
    drive_record: Callable[[str, WorkflowRecord], object] | None = None,
) -> ReclaimTargetHandle:
    """Build the reclaim target of one engine (see :class:`ReclaimTargetHandle`)."""
    return ReclaimTargetHandle(
        registry,
        storage,
        metrics,
        on_reclaimed,
        is_eligible,
        skip_live_holders=skip_live_holders,
        max_claims=max_claims,
        fair_share=fair_share,
        discovery=discovery,
        drive_record=drive_record,
    )
