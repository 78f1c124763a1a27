"""How ``Ownership.claim()`` gets a claim: acquire, take over an expired holder, optionally wait.

A claim taken with ``claim()`` may have no workflow record (a *bare* claim: a cron job's leader
lock, any unit of work a host names by id). The reclaim pass never clears those, since it only
takes over workflow records this engine can drive; so ``claim()`` itself takes over a holder that
expired more than the takeover grace ago (epoch + 1, the same fenced takeover the reclaim pass
makes). A crashed process's ``claim()`` therefore blocks its id for at most the TTL plus the
grace, never forever; and when this engine's crash probe (``background="thread"``) sees the
holder's engine crashed, at once: a waiter wakes when the probe reports a crash and takes the
claim over before its expiry (still fenced: epoch + 1, conditioned on the bytes it read). Only
the crashed engine's own claims go early: a verdict carries the record it was judged on, and a
holder whose engine has another record by the takeover's read (an engine restarted under the
same id) keeps its claim until it expires.

With ``wait``, attempts repeat with jittered, growing delays until one succeeds or ``wait``
seconds have passed. Nothing here holds a lock; the caller's ``still_open`` check runs before
every attempt so a closing ``Ownership`` stops waiting.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final

from .. import keys
from ..claims.registry import ClaimRegistry
from ..claims.results import AcquireStatus, TakeoverStatus
from ..codec import decode_epoch
from ..metrics import ClaimMetrics
from .claim_handle import ClaimHandle

_log = logging.getLogger(__name__)

_ATTEMPTS: Final = 3
"""Acquire/takeover rounds of one attempt: a holder released in between is acquired afresh."""
_FIRST_DELAY_S: Final = 0.05
_MAX_DELAY_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class ClaimAttempt:
    """The outcome of one :func:`attempt_claim`: ``epoch`` and its ``token`` (the epoch-key
    bytes) when acquired, else ``held_by``."""

    epoch: int | None
    held_by: str | None = None
    token: bytes = b""


def attempt_claim(
    registry: ClaimRegistry,
    metrics: ClaimMetrics,
    workflow_id: str,
    dead_engines: Callable[[], Collection[str]] = frozenset,
) -> ClaimAttempt:
    """Acquire ``workflow_id``, or take it over if its holder expired past the grace, or names
    one of ``dead_engines()`` (engines the crash probe saw crashed, each mapped to the record
    bytes it was judged on: taken before expiry while that record is unchanged; asked only when
    the acquire found a holder).

    Counts ``acquired``, ``takeover``, ``backoff_skipped`` or ``lost_race`` in ``metrics``.
    """
    held_by: str | None = None
    for _ in range(_ATTEMPTS):
        acquired = registry.acquire(workflow_id)
        if acquired.status is AcquireStatus.ACQUIRED and acquired.epoch is not None:
            metrics.record_claim_attempt("acquired")
            return ClaimAttempt(acquired.epoch, token=acquired.token or b"")
        held_by = acquired.held_by
        taken = registry.takeover(workflow_id, dead_engines=dead_engines())
        if taken.status is TakeoverStatus.ACQUIRED and taken.epoch is not None:
            metrics.record_claim_attempt("takeover")
            return ClaimAttempt(taken.epoch, token=taken.token or b"")
        if taken.status is TakeoverStatus.NO_CLAIM:
            continue  # released since the acquire read it: acquire afresh
        if taken.status is TakeoverStatus.BACKOFF_SKIPPED:
            metrics.record_claim_attempt("backoff_skipped")
            return ClaimAttempt(None, held_by)
        metrics.record_claim_attempt("lost_race")
        return ClaimAttempt(None, taken.held_by or held_by)
    metrics.record_claim_attempt("lost_race")
    return ClaimAttempt(None, held_by)


def claim_with_wait(
    attempt: Callable[[], ClaimAttempt],
    wait_s: float | None,
    still_open: Callable[[], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> ClaimAttempt:
    """Call ``attempt`` until it acquires or ``wait_s`` seconds passed; return the last outcome.

    :param attempt: one claim attempt.
    :param wait_s: how long to keep trying; ``None`` or ``0`` makes exactly one attempt.
    :param still_open: raises (e.g. ``ClosedError``) when attempts must stop.
    :param sleep: waits between attempts (seconds).
    """
    if not wait_s:
        still_open()
        return attempt()
    deadline = time.monotonic() + wait_s
    delay = _FIRST_DELAY_S
    while True:
        still_open()
        outcome = attempt()
        remaining = deadline - time.monotonic()
        if outcome.epoch is not None or remaining <= 0:
            return outcome
        # Jitter spreads the retries of several waiters so they do not collide in lockstep.
        pause = min(remaining, random.uniform(delay / 2, delay))
        _log.debug("claim unavailable (held by %r); retrying in %.3f s", outcome.held_by, pause)
        sleep(pause)
        delay = min(delay * 2, _MAX_DELAY_S)


def claim_is_gone(registry: ClaimRegistry, handle: ClaimHandle) -> bool:
    """Whether a claim-lost report for ``handle``'s id concerns ``handle``'s own claim."""
    wid = handle.workflow_id
    if registry.current_epoch(wid) != handle.epoch:
        # A lost renewal drops the registry entry before it reports.
        return True
    # A fenced write reports while the registry still tracks the epoch, and so does a late
    # renewal of an older generation: the stored epoch tells which one this is.
    try:
        stored = decode_epoch(registry.storage.get(keys.workflow_owner_epoch(wid)))
    except Exception:
        _log.warning(
            "could not read the epoch of workflow %r; treating its claim as lost",
            wid,
            exc_info=True,
        )
        return True
    return stored != handle.epoch
