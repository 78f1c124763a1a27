"""Owner-side polls: the owner notices signals and updates that other engines stored durably.

There is no cross-engine RPC. A signal or update submitted on an engine that does not own the
workflow is only buffered in the store; the owner finds it on its next poll, so delivery is
bounded by one maintenance interval.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from ..clock import Clock
from .targets import (
    ParkedSignalWait,
    SignalPollOutcome,
    SignalPollResult,
    SignalPollStatus,
    SignalPollTarget,
    UpdatePollOutcome,
    UpdatePollResult,
    UpdatePollStatus,
    UpdatePollTarget,
)

_log = logging.getLogger(__name__)

WAIT_SIGNAL: Final = "wait-signal"
"""The :attr:`ParkedOperation.kind` of a workflow parked until a signal arrives."""


def run_owner_side_signal_poll(target: SignalPollTarget, clock: Clock) -> SignalPollResult:
    """Wake every parked signal wait whose signal is already buffered, one wait after another.

    The waits are listed once. Each is probed with ``has_buffered_signal`` (which does not consume
    the signal): not buffered → ``not-buffered``; buffered → ``wake_workflow``, giving ``woken``,
    or ``wake-failed`` with the error if the wake raised (the poll goes on). Several waits of one
    workflow are probed independently.

    :raises Exception: whatever the listing, a probe or ``clock`` raised; a probe that cannot
        answer fails the whole poll rather than guessing.
    """
    started_at = clock()
    waits = list(target.list_parked_signal_waits())
    outcomes: list[SignalPollOutcome] = []
    for wait in waits:
        outcomes.append(_poll_signal_wait(target, wait))
    finished_at = clock()
    woken = sum(1 for o in outcomes if o.status is SignalPollStatus.WOKEN)
    return SignalPollResult(started_at, finished_at, tuple(outcomes), woken)


def _poll_signal_wait(target: SignalPollTarget, wait: ParkedSignalWait) -> SignalPollOutcome:
    workflow_id, signal_name = wait.workflow_id, wait.signal_name
    if not target.has_buffered_signal(workflow_id, signal_name):
        return SignalPollOutcome(workflow_id, signal_name, SignalPollStatus.NOT_BUFFERED)
    try:
        target.wake_workflow(workflow_id)
    except Exception as exc:
        return SignalPollOutcome(workflow_id, signal_name, SignalPollStatus.WAKE_FAILED, exc)
    return SignalPollOutcome(workflow_id, signal_name, SignalPollStatus.WOKEN)


def run_owner_side_update_poll(target: UpdatePollTarget, clock: Clock) -> UpdatePollResult:
    """Drain the pending updates of every held workflow that has some, one after another.

    Each held id is probed with ``has_pending_updates``: false → ``no-pending-updates``; true →
    ``drain_pending_updates``, giving ``drained``, or ``drain-failed`` with the error if the drain
    raised (the poll goes on).

    :raises Exception: whatever the listing, a probe or ``clock`` raised.
    """
    started_at = clock()
    workflow_ids = list(target.list_held_workflow_ids())
    outcomes: list[UpdatePollOutcome] = []
    for workflow_id in workflow_ids:
        if not target.has_pending_updates(workflow_id):
            outcomes.append(UpdatePollOutcome(workflow_id, UpdatePollStatus.NO_PENDING_UPDATES))
            continue
        try:
            target.drain_pending_updates(workflow_id)
        except Exception as exc:
            outcomes.append(UpdatePollOutcome(workflow_id, UpdatePollStatus.DRAIN_FAILED, exc))
        else:
            outcomes.append(UpdatePollOutcome(workflow_id, UpdatePollStatus.DRAINED))
    finished_at = clock()
    drained = sum(1 for o in outcomes if o.status is UpdatePollStatus.DRAINED)
    return UpdatePollResult(started_at, finished_at, tuple(outcomes), drained)


# --------------------------------------------------------------------------------------------
# The production signal-poll target
# --------------------------------------------------------------------------------------------


class SignalWakeDecision(str, enum.Enum):
    """Answer of ``confirm_signal_wake_ownership``: wake the waiter, or drop the wake."""

    PROCEED = "proceed"
    DISCARD = "discard"


@dataclass(frozen=True, slots=True)
class ParkedOperation:
    """A workflow parked in its checkpoint (not in memory) on ``kind`` (e.g. ``"wait-signal"``).

    ``signal_name`` names the awaited signal when ``kind`` is :data:`WAIT_SIGNAL`.
    """

    workflow_id: str
    kind: str
    signal_name: str | None = None


@dataclass(frozen=True, slots=True)
class LiveSignalWaiter:
    """An in-memory waiter of a running workflow; ``waiter_key`` is ``"<workflow_id>:<signal>"``."""

    workflow_id: str
    waiter_key: str


@runtime_checkable
class SignalPollSources(Protocol):
    """What the host exposes so the signal poll can find and wake its parked waits.

    - ``list_checkpoint_parked_operations()``: workflows parked in their durable checkpoint.
    - ``is_checkpoint_parked(id)`` / ``resume_parked_workflow(id)``: resume a parked workflow
      (that path runs its own standalone-claim check before any user code).
    - ``list_live_signal_waiters()`` / ``wake_live_waiter(id, waiter_key)``: in-memory waiters of
      running workflows, e.g. branches of a race waiting on different signals.
    - ``has_buffered_signal(id, name)``: probe the durable signal buffer without consuming it.
    - ``confirm_signal_wake_ownership(id)``: **required** ownership fence run right before a live
      waiter is woken; returns ``"proceed"`` or ``"discard"`` (a deposed engine must not wake).
    """

    def list_checkpoint_parked_operations(self) -> Iterable[ParkedOperation]: ...

    def is_checkpoint_parked(self, workflow_id: str) -> bool: ...

    def resume_parked_workflow(self, workflow_id: str) -> None: ...

    def list_live_signal_waiters(self) -> Iterable[LiveSignalWaiter]: ...

    def wake_live_waiter(self, workflow_id: str, waiter_key: str) -> None: ...

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool: ...

    def confirm_signal_wake_ownership(self, workflow_id: str) -> str: ...


_REQUIRED_SOURCE_METHODS: Final = (
    "list_checkpoint_parked_operations",
    "is_checkpoint_parked",
    "resume_parked_workflow",
    "list_live_signal_waiters",
    "wake_live_waiter",
    "has_buffered_signal",
    "confirm_signal_wake_ownership",
)


def build_owner_side_signal_poll_target(sources: SignalPollSources) -> SignalPollTarget:
    """Build the signal-poll target a host wires into the renewal task.

    Waits are the checkpoint-parked ``wait-signal`` operations plus every live waiter (its signal
    name is the waiter key with the ``"<id>:"`` prefix removed — split on the known id, never on
    ``":"``, because ids and signal names may contain colons). ``wake_workflow(id)`` resumes a
    checkpoint-parked workflow; otherwise it re-probes each live waiter's *own* signal and wakes
    only waiters whose signal is buffered and whose wake ``confirm_signal_wake_ownership``
    answers ``"proceed"`` — so a sibling race branch whose signal never arrived is never woken.
    An unknown id is a no-op.

    :raises TypeError: ``sources`` lacks one of the :class:`SignalPollSources` methods
        (``confirm_signal_wake_ownership`` included: the fence is not optional).
    """
    missing = [
        name for name in _REQUIRED_SOURCE_METHODS if not callable(getattr(sources, name, None))
    ]
    if missing:
        raise TypeError(
            f"signal-poll sources {type(sources).__name__} lack {', '.join(missing)}; every "
            f"SignalPollSources method is required (without confirm_signal_wake_ownership a "
            f"deposed engine could wake a workflow it no longer owns)"
        )
    return _OwnerSideSignalPollTarget(sources)


class _OwnerSideSignalPollTarget:
    """:class:`SignalPollTarget` over a host's :class:`SignalPollSources`; holds no state."""

    def __init__(self, sources: SignalPollSources) -> None:
        self._sources = sources

    def list_parked_signal_waits(self) -> list[ParkedSignalWait]:
        waits = [
            ParkedSignalWait(op.workflow_id, op.signal_name)
            for op in self._sources.list_checkpoint_parked_operations()
            if op.kind == WAIT_SIGNAL and op.signal_name is not None
        ]
        for waiter in self._sources.list_live_signal_waiters():
            signal_name = _waiter_signal_name(waiter)
            if signal_name is not None:
                waits.append(ParkedSignalWait(waiter.workflow_id, signal_name))
        return waits

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool:
        return bool(self._sources.has_buffered_signal(workflow_id, signal_name))

    def wake_workflow(self, workflow_id: str) -> None:
        sources = self._sources
        if sources.is_checkpoint_parked(workflow_id):
            sources.resume_parked_workflow(workflow_id)
            return
        waiters = [w for w in sources.list_live_signal_waiters() if w.workflow_id == workflow_id]
        for waiter in waiters:
            signal_name = _waiter_signal_name(waiter)
            if signal_name is None or not sources.has_buffered_signal(workflow_id, signal_name):
                continue
            if _confirm(sources, workflow_id) is SignalWakeDecision.DISCARD:
                _log.debug("discarded the %r signal wake of workflow %r", signal_name, workflow_id)
                continue
            sources.wake_live_waiter(workflow_id, waiter.waiter_key)


def _confirm(sources: SignalPollSources, workflow_id: str) -> SignalWakeDecision:
    decision = sources.confirm_signal_wake_ownership(workflow_id)
    try:
        return SignalWakeDecision(decision)
    except ValueError:
        raise ValueError(
            f"confirm_signal_wake_ownership({workflow_id!r}) returned {decision!r}; it must "
            f"return 'proceed' or 'discard'"
        ) from None


def _waiter_signal_name(waiter: LiveSignalWaiter) -> str | None:
    prefix = waiter.workflow_id + ":"
    if not waiter.waiter_key.startswith(prefix):
        _log.warning(
            "ignoring live signal waiter key %r: it must start with the workflow id prefix %r",
            waiter.waiter_key,
            prefix,
        )
        return None
    return waiter.waiter_key[len(prefix) :]
