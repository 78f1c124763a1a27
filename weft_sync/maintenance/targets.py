"""What the renewal task drives (target protocols) and what its passes report (result records).

A *target* adapts one concern — renewing held claims, reclaiming stranded ones, polling parked
signal waits, polling pending updates — to the task. Targets are plain objects; the task calls
them from its own threads, so every target method must be safe to call from any thread and, for
the renewal and reclaim targets, from up to :data:`RENEWAL_CONCURRENCY` threads at once.

Expected outcomes are values: every result is a frozen dataclass whose ``status`` is a ``str``
enum member comparing equal to the plain string (``outcome.status == "renewed"``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from ..reclaim.attempts import TAKEOVER_MAX_ATTEMPTS as TAKEOVER_MAX_ATTEMPTS
from ..reclaim.attempts import ReclaimAttemptResult as ReclaimAttemptResult

RENEWAL_CONCURRENCY: Final = 16
"""At most this many renewals (or renewal chunks) of one sub-pass run at once."""

RECLAIM_CONCURRENCY: Final = 16
"""At most this many takeover attempts of one reclaim pass run at once."""

RECLAIM_CHUNK_SIZE: Final = 200
"""Candidates handed to one ``prepare_workflow_claim_takeovers`` call of a batched target."""

RENEWAL_CHUNK_SIZE: Final = 1000
"""Default number of ids handed to one ``renew_workflow_claims`` call of a batched target."""


# --------------------------------------------------------------------------------------------
# Target protocols
# --------------------------------------------------------------------------------------------


@runtime_checkable
class RenewalTarget(Protocol):
    """Keeps this engine's held claims alive.

    - ``list_held_workflow_ids()`` returns a snapshot of the ids currently held; the task reads it
      once per pass.
    - ``renew_workflow_claim(id)`` renews one claim and returns normally when the claim is still
      held (or was released meanwhile: not a failure); it raises when the renewal failed, either
      because the claim was lost or because the store failed. A raise is recorded as a ``failed``
      outcome for that id only.
    """

    def list_held_workflow_ids(self) -> Sequence[str]: ...

    def renew_workflow_claim(self, workflow_id: str) -> None: ...


@runtime_checkable
class BatchRenewalTarget(RenewalTarget, Protocol):
    """A :class:`RenewalTarget` that can also renew many claims in one call.

    ``renew_workflow_claims(ids)`` renews every id with exactly the per-id semantics of
    ``renew_workflow_claim`` and returns a list of the same length: ``None`` where the renewal
    succeeded, the exception object where it failed. Raising fails every id of the call with that
    exception. The renewal sub-pass prefers this method whenever the target has it, handing it
    chunks of ids (``chunk_size``, default :data:`RENEWAL_CHUNK_SIZE`) spread over the pool.
    """

    def renew_workflow_claims(self, workflow_ids: Sequence[str]) -> list[Exception | None]: ...


@runtime_checkable
class ReclaimTarget(Protocol):
    """Finds claims stranded by dead engines and takes them over.

    - ``list_reclaim_candidate_workflow_ids()`` returns the ids worth an attempt this pass; raising
      makes the pass report ``discovery-failed``.
    - ``attempt_workflow_claim_takeover(id)`` tries once (with its own bounded retries) and returns
      a :class:`ReclaimAttemptResult` or its plain string value; raising is recorded as an
      ``error`` outcome for that id only.
    """

    def list_reclaim_candidate_workflow_ids(self) -> Sequence[str]: ...

    def attempt_workflow_claim_takeover(self, workflow_id: str) -> str: ...


@runtime_checkable
class BatchReclaimTarget(ReclaimTarget, Protocol):
    """A :class:`ReclaimTarget` that can make the first takeover attempt of many candidates at once.

    - ``prepare_workflow_claim_takeovers(ids)`` returns one opaque plan per id, in order. It may
      make the first takeover attempt of each id (one read and one commit for all of them); it
      decides nothing that ``complete_workflow_claim_takeover`` does not then finish. Raising
      fails every id of the call with that exception.
    - ``complete_workflow_claim_takeover(plan)`` finishes one id exactly as
      ``attempt_workflow_claim_takeover`` would from that point (its remaining retries, the
      re-checks, the drive) and returns a :class:`ReclaimAttemptResult` or its value; raising is
      recorded as an ``error`` outcome for that id only. Every plan must be completed: a plan may
      stand for a claim already taken over.

    The reclaim pass prefers this pair whenever the target has it: it prepares chunks of
    :data:`RECLAIM_CHUNK_SIZE` candidates spread over the pool, then completes every plan, one per
    pool item, as it would attempt them.
    """

    def prepare_workflow_claim_takeovers(self, workflow_ids: Sequence[str]) -> Sequence[object]: ...

    def complete_workflow_claim_takeover(self, plan: object) -> str: ...


@dataclass(frozen=True, slots=True)
class ParkedSignalWait:
    """A workflow parked until a signal named ``signal_name`` arrives."""

    workflow_id: str
    signal_name: str


@runtime_checkable
class SignalPollTarget(Protocol):
    """Lets the owner notice signals that were buffered durably by another engine.

    - ``list_parked_signal_waits()`` returns the waits parked on this engine.
    - ``has_buffered_signal(id, name)`` probes the durable buffer without consuming it; raising
      fails the whole poll.
    - ``wake_workflow(id)`` wakes the workflow so it consumes its signal; raising is recorded as
      ``wake-failed`` for that wait only.
    """

    def list_parked_signal_waits(self) -> Iterable[ParkedSignalWait]: ...

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool: ...

    def wake_workflow(self, workflow_id: str) -> None: ...


@runtime_checkable
class UpdatePollTarget(Protocol):
    """Lets the owner deliver updates that were submitted on another engine.

    - ``list_held_workflow_ids()`` returns the ids this engine owns.
    - ``has_pending_updates(id)`` probes without consuming; raising fails the whole poll.
    - ``drain_pending_updates(id)`` delivers them; raising is recorded as ``drain-failed`` for
      that id only.
    """

    def list_held_workflow_ids(self) -> Sequence[str]: ...

    def has_pending_updates(self, workflow_id: str) -> bool: ...

    def drain_pending_updates(self, workflow_id: str) -> None: ...


# --------------------------------------------------------------------------------------------
# Result records
# --------------------------------------------------------------------------------------------


class RenewalStatus(str, enum.Enum):
    """Outcome of renewing one held claim."""

    RENEWED = "renewed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class RenewalOutcome:
    """How renewing ``workflow_id`` went; ``error`` is the exception when it ``failed``."""

    workflow_id: str
    status: RenewalStatus
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class RenewalSubpassResult:
    """Every renewal of one sub-pass, in the order the ids were given."""

    outcomes: tuple[RenewalOutcome, ...]
    renewed_count: int
    failed_count: int


class ReclaimOutcomeStatus(str, enum.Enum):
    """Outcome of one reclaim attempt: a :class:`ReclaimAttemptResult` value or ``error``."""

    RECLAIMED = "reclaimed"
    NOT_ELIGIBLE = "not-eligible"
    BACKOFF_SKIPPED = "backoff-skipped"
    LOST_RACE = "lost-race"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ReclaimOutcome:
    """How the attempt on ``workflow_id`` went; ``error`` is set when the status is ``error``."""

    workflow_id: str
    status: ReclaimOutcomeStatus
    error: Exception | None = None


class ReclaimPassStatus(str, enum.Enum):
    """Whether the reclaim pass could list its candidates."""

    COMPLETED = "completed"
    DISCOVERY_FAILED = "discovery-failed"


@dataclass(frozen=True, slots=True)
class ReclaimPassResult:
    """One reclaim pass: ``completed`` with positional ``outcomes``, or ``discovery-failed``.

    ``error`` is the listing's exception when discovery failed (then ``outcomes`` is empty).
    """

    status: ReclaimPassStatus
    outcomes: tuple[ReclaimOutcome, ...] = ()
    reclaimed_count: int = 0
    error: Exception | None = None


class SignalPollStatus(str, enum.Enum):
    """Outcome of probing one parked signal wait."""

    WOKEN = "woken"
    NOT_BUFFERED = "not-buffered"
    WAKE_FAILED = "wake-failed"


@dataclass(frozen=True, slots=True)
class SignalPollOutcome:
    """How the wait of ``workflow_id`` on ``signal_name`` went; ``error`` when ``wake-failed``."""

    workflow_id: str
    signal_name: str
    status: SignalPollStatus
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class SignalPollResult:
    """One owner-side signal poll, with clock readings taken before and after it."""

    started_at: int
    finished_at: int
    outcomes: tuple[SignalPollOutcome, ...]
    woken_count: int


class UpdatePollStatus(str, enum.Enum):
    """Outcome of probing one held workflow for pending updates."""

    DRAINED = "drained"
    NO_PENDING_UPDATES = "no-pending-updates"
    DRAIN_FAILED = "drain-failed"


@dataclass(frozen=True, slots=True)
class UpdatePollOutcome:
    """How ``workflow_id``'s pending updates went; ``error`` when ``drain-failed``."""

    workflow_id: str
    status: UpdatePollStatus
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class UpdatePollResult:
    """One owner-side update poll, with clock readings taken before and after it."""

    started_at: int
    finished_at: int
    outcomes: tuple[UpdatePollOutcome, ...]
    drained_count: int


class SubpassStatus(str, enum.Enum):
    """Whether a poll sub-pass ran to the end (``completed``) or raised (``failed``)."""

    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class SignalPollSubpassResult:
    """``completed`` with the poll's ``result``, or ``failed`` with the ``error`` it raised."""

    status: SubpassStatus
    result: SignalPollResult | None = None
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class UpdatePollSubpassResult:
    """``completed`` with the poll's ``result``, or ``failed`` with the ``error`` it raised."""

    status: SubpassStatus
    result: UpdatePollResult | None = None
    error: Exception | None = None


class PassKind(str, enum.Enum):
    """Which part of the maintenance a :class:`PassResult` reports.

    ``run_once()`` reports ``full`` passes; interval mode reports one partial result per slot.
    """

    FULL = "full"
    RENEWAL = "renewal"
    RECLAIM = "reclaim"
    SIGNAL_POLL = "signal-poll"
    UPDATE_POLL = "update-poll"


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one maintenance pass did.

    ``outcomes``/``renewed_count``/``failed_count`` describe the renewal sub-pass (empty and 0 in
    a partial result of another slot). ``reclaim``, ``signal_poll`` and ``update_poll`` are
    ``None`` exactly when that sub-pass was not part of this pass (no target configured, or a
    partial result of another slot). ``started_at``/``finished_at`` are clock readings.
    """

    started_at: int
    finished_at: int
    outcomes: tuple[RenewalOutcome, ...]
    renewed_count: int
    failed_count: int
    reclaim: ReclaimPassResult | None = None
    signal_poll: SignalPollSubpassResult | None = None
    update_poll: UpdatePollSubpassResult | None = None
    kind: PassKind = PassKind.FULL
