"""Drivers: a claim is held *for* a driver, and a claim whose driver is gone is given back.

A workflow claim says "this engine is alive"; a driver says "this workflow is being worked on".
Every workflow claim this engine takes through the ledger or the reclaim pass is tracked here
with the driver working on it:

- host code inside ``with workflows.drive(workflow_id) as ctx:`` (the block's thread);
- a handler the library runs on its handler executor (that thread, for the length of the call);
- nobody yet: a claim just taken by ``start()``/``resume()``, or handed to ``on_reclaimed`` or to
  a host that drives types it declared eligible. Such a claim *awaits* a driver for a grace of
  one renew interval from the moment it was taken (time for the host to enter ``drive()``).

A drive *ends unfinished* when its ``drive()`` block raises or returns, or its handler raises,
while this engine still holds the claim at the drive's epoch (``complete``, ``fail``,
``suspend``, ``cancel`` and a lost claim all end the claim, so a finished drive is one whose
claim is gone). A handler that *returns* without finishing hands the claim on: it awaits a
driver again for one renew interval (host code it passed the id to enters ``drive()`` once the
handler returned; while a handler runs, a ``drive()`` on another thread is refused). A drive
whose thread is no longer alive ends unfinished at the next check, and so does a claim awaiting
a driver past its grace, except once: a claim taken by ``start()``/``resume()`` that nobody drove
within its grace is first handed to this engine's handler for its type, if it has one
(:meth:`DriverTracker.bind_offer`), without counting an attempt. Each of the others is counted
as an attempt of that workflow on this engine; below ``max_attempts`` the claim is released
(epoch kept), so
the next reclaim pass of any engine with a handler for its type acquires it and drives it
again, after a backoff of ``(attempts - 1)`` renew intervals on this engine. At
``max_attempts`` this engine fails the workflow with the last error instead (one write, release
included): a workflow that no driver can finish is not redriven for ever. Attempts are counted
per engine, in memory: another engine starts its own count.

A drive writes with its own epoch token: a fenced write, finish or host transaction made on a
thread inside a drive of a workflow (:meth:`DriverTracker.drive_token`) is refused
(``EngineDeposedError``, cause ``"superseded"``) once this engine holds the workflow with another
token. That happens when this engine lost the claim (its renewals failed past the local deadline,
or the store went back to an older state) while the drive went on, and then took the workflow
again for a new driver: without this, the old drive and the new one would both pass the fence,
and the old one could overwrite the new one's checkpoint. Tokens are compared, not epoch
numbers: after a store rollback the same number is minted again, with another token.

Claims not taken through the ledger (``Ownership.claim()`` blocks, which their ``with`` block's
thread drives, and direct ``ClaimRegistry`` use) are not tracked.

:meth:`DriverTracker.check` runs after every renewal sub-pass, on a maintenance thread.
:meth:`DriverTracker.undriven_claims` is what the engine's heartbeat publishes in its engine
record (read by ``weft-sync claims`` and ``show``): the claims awaiting a driver within their
grace, and those without one — past the grace or with a driver thread that ended (the check
after the same pass releases them), or given back by a release that failed (the holder stays in
the store until it expires, at most one claim TTL later). The tracker has one lock, guarding its
maps; storage I/O, logging and the dispose callback run outside it. Which drives a thread is inside
is that thread's own (a ``threading.local``), read and written only by it, without the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..claims.registry import ClaimRegistry
from ..codec import decode_epoch
from ..errors import WorkflowClaimUnavailableError
from ..metrics import ClaimMetrics
from ..reclaim.engine_records import UndrivenClaims

_log = logging.getLogger(__name__)

_NOTHING_DROVE_IT = "nothing drove it"

DisposeCallback = Callable[[str, dict[str, Any]], object]
"""``(workflow_id, error) -> None``: end a workflow no driver could finish (``Workflows.fail``)."""

OfferCallback = Callable[[str], bool]
"""``(workflow_id) -> queued``: queue this engine's handler for a claim nobody drove within its
grace (``HandlerTable.offer``); ``False`` when the workflow's type has no handler here."""


@dataclass(eq=False, slots=True)
class Driver:
    """One live drive of one claim: who drives it, at which epoch and with which token."""

    workflow_id: str
    epoch: int
    kind: str
    thread: threading.Thread
    token: bytes = b""
    """The epoch token the claim was held with as the drive began (``b""``: it was not held at
    ``epoch`` any more); its writes are made with it."""
    nested: bool = False
    """Entered on the thread already driving the claim (a handler's own ``drive()`` block):
    the outer drive decides what happens to the claim."""


@dataclass(slots=True)
class _Tracked:
    epoch: int
    token: bytes | None  # the claim's epoch token when it was tracked (None: not held then)
    since: int
    driver: Driver | None = None
    queued: bool = False  # a handler run waits for a free handler thread: driven by then
    offered: bool = False  # a handler of this engine was (or is being) given the claim


class DriverTracker:
    """The drivers of the workflow claims one engine holds (see the module docstring).

    :param registry: the engine's claim registry.
    :param metrics: receives the without-driver gauge and the redrive counts.
    :param max_attempts: unfinished drives of one workflow before it is disposed of.
    :param dispose: fails a workflow no driver could finish.
    """

    def __init__(
        self,
        registry: ClaimRegistry,
        metrics: ClaimMetrics,
        *,
        max_attempts: int,
        dispose: DisposeCallback,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._dispose = dispose
        self._grace_ms = registry.claim_renew_interval_ms
        # _lock guards _tracked, _attempts, _not_before, _last_error, _left_to_expire and
        # _releasing.
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._attempts: dict[str, int] = {}
        self._not_before: dict[str, int] = {}
        self._last_error: dict[str, str] = {}
        # Undriven claims whose release failed -> when their holder has expired at the latest.
        self._left_to_expire: dict[str, int] = {}
        # Undriven claims check() is releasing now: a drive entering meanwhile is refused.
        self._releasing: set[str] = set()
        self._offer: OfferCallback | None = None  # set once by bind_offer(), before any check()
        # Per thread: workflow id -> the epoch tokens of the drives the thread is inside,
        # innermost last (a handler's own drive() block nests in the handler's drive).
        self._here = threading.local()

    def bind_offer(self, offer: OfferCallback) -> None:
        """Hand claims nobody drove within their grace to ``offer`` (this engine's handlers)
        before giving them back; called once, while the engine is built."""
        self._offer = offer

    # -- claims and drivers ------------------------------------------------------------------

    def expect(self, workflow_id: str, epoch: int, *, queued: bool = False) -> None:
        """Track a claim just taken at ``epoch``; it awaits a driver for one renew interval.

        :param queued: its handler run is queued on the handler executor: it counts as driven
            until the run starts (and its grace starts afresh if it hands the claim on).
        """
        now = self._registry.clock()
        token = self._held_token(workflow_id, epoch)
        with self._lock:
            self._left_to_expire.pop(workflow_id, None)
            current = self._tracked.get(workflow_id)
            if current is None or current.epoch != epoch or current.token != token:
                self._tracked[workflow_id] = _Tracked(
                    epoch, token, now, queued=queued, offered=queued
                )
            elif current.driver is None:
                current.since, current.queued = now, queued
                current.offered = current.offered or queued

    @contextmanager
    def driving(
        self, workflow_id: str, epoch: int, kind: str, *, hand_off: bool = False
    ) -> Iterator[Driver]:
        """Drive the claim at ``epoch`` on this thread for the block; judge the drive after it.

        The block's exception propagates; the drive is judged either way (see :meth:`leave`).
        The drive writes with the token the claim is held with as it begins (:attr:`Driver.token`;
        when the claim is not held at ``epoch`` any more, none: every write is refused).
        """
        driver = self.enter(workflow_id, epoch, kind)
        tokens = self._drives_here().setdefault(workflow_id, [])
        tokens.append(driver.token)
        try:
            yield driver
        except BaseException as exc:
            self._left_here(workflow_id, tokens)
            self.leave(driver, exc)
            raise
        self._left_here(workflow_id, tokens)
        self.leave(driver, None, hand_off=hand_off)

    def drive_token(self, workflow_id: str) -> bytes | None:
        """The epoch token of the innermost drive of ``workflow_id`` the calling thread is
        inside, or ``None`` when it drives none: the token its fenced writes must be made with."""
        drives: dict[str, list[bytes]] | None = getattr(self._here, "drives", None)
        if not drives:
            return None
        tokens = drives.get(workflow_id)
        return tokens[-1] if tokens else None

    def narrowed(self, lookup: Callable[[str], bytes | None]) -> Callable[[str], bytes | None]:
        """``lookup`` (the epoch token of a held claim, or ``None``) as the calling thread may
        write with it: ``None`` inside a drive of the workflow with another token than the one
        held (the host fence's ``epoch_of``)."""

        def narrowed(workflow_id: str) -> bytes | None:
            token = lookup(workflow_id)
            if token is None:
                return None
            driving = self.drive_token(workflow_id)
            return token if driving is None or driving == token else None

        return narrowed

    def _held_token(self, workflow_id: str, epoch: int) -> bytes | None:
        """The token this engine holds ``workflow_id`` with, if it holds it at ``epoch``."""
        token = self._registry.current_epoch_bytes(workflow_id)
        return token if token is not None and decode_epoch(token) == epoch else None

    def _drives_here(self) -> dict[str, list[bytes]]:
        drives: dict[str, list[bytes]] | None = getattr(self._here, "drives", None)
        if drives is None:
            drives = self._here.drives = {}
        return drives

    def _left_here(self, workflow_id: str, tokens: list[bytes]) -> None:
        tokens.pop()
        if not tokens:
            self._here.drives.pop(workflow_id, None)

    def enter(self, workflow_id: str, epoch: int, kind: str) -> Driver:
        """Register the current thread as the driver of the claim at ``epoch``.

        :raises WorkflowClaimUnavailableError: a live driver on another thread of this engine
            (a ``drive()`` block or a handler) already drives this claim (``held_by`` is this
            engine's id). One claim has one driver. Also while :meth:`check` releases the claim
            as undriven: it is the redrive's to drive.
        """
        token = self._held_token(workflow_id, epoch)
        driver = Driver(workflow_id, epoch, kind, threading.current_thread(), token or b"")
        now = self._registry.clock()
        with self._lock:
            releasing = workflow_id in self._releasing
            busy = None
            if not releasing:
                self._left_to_expire.pop(workflow_id, None)
                tracked = self._tracked.get(workflow_id)
                if tracked is None or tracked.epoch != epoch or tracked.token != token:
                    tracked = self._tracked[workflow_id] = _Tracked(epoch, token, now)
                other = tracked.driver
                if other is not None and other.thread is driver.thread:
                    driver.nested = True
                elif other is not None and other.thread.is_alive():
                    busy = other
                else:
                    tracked.queued = False
                    tracked.driver = driver
        if releasing:
            _log.debug(
                "workflow %r (epoch %d) is being released as undriven; not driven here",
                workflow_id,
                epoch,
            )
            raise WorkflowClaimUnavailableError(
                workflow_id, self._registry.engine_id, held_here=True
            )
        if busy is not None:
            _log.debug(
                "workflow %r (epoch %d) is already driven by %s on thread %s",
                workflow_id,
                epoch,
                busy.kind,
                busy.thread.name,
            )
            raise WorkflowClaimUnavailableError(
                workflow_id, self._registry.engine_id, held_here=True
            )
        return driver

    def leave(self, driver: Driver, error: BaseException | None, *, hand_off: bool = False) -> None:
        """End ``driver``'s drive; an unfinished one releases (or disposes of) the claim.

        :param hand_off: a drive that returned without finishing hands the claim on instead:
            it awaits a driver for one more renew interval (a handler that passed the id to
            host code which enters ``drive()``), and is released only if none comes.
        """
        wid = driver.workflow_id
        if driver.nested:
            return
        with self._lock:
            tracked = self._tracked.get(wid)
            if tracked is not None and tracked.driver is driver:
                tracked.driver = None
        held = self._registry.current_epoch_bytes(wid)
        if held is None:
            self._finished(wid, driver.epoch)  # finished, or lost: its claim ended
            return
        if held != driver.token:
            # Superseded: the drive of the later claim counts from here. Tokens, not epoch
            # numbers: a store that went back in time mints the same number again.
            return
        if hand_off and error is None:
            now = self._registry.clock()
            with self._lock:
                tracked = self._tracked.get(wid)
                if tracked is not None and tracked.epoch == driver.epoch:
                    tracked.since = now
            return
        reason = (
            f"its {driver.kind} returned without finishing it"
            if error is None
            else f"its {driver.kind} raised {type(error).__name__}: {error}"
        )
        self._unfinished(wid, driver.epoch, reason)

    def clear(self, workflow_id: str) -> None:
        """Forget ``workflow_id`` (its claim ended)."""
        with self._lock:
            self._tracked.pop(workflow_id, None)

    def attempts(self, workflow_id: str) -> int:
        """Unfinished drives of ``workflow_id`` counted on this engine since it last finished."""
        with self._lock:
            return self._attempts.get(workflow_id, 0)

    def deferred(self, workflow_id: str) -> bool:
        """Whether ``workflow_id`` is in its redrive backoff on this engine."""
        now = self._registry.clock()
        with self._lock:
            not_before = self._not_before.get(workflow_id)
            if not_before is not None and now >= not_before:
                del self._not_before[workflow_id]
                return False
            return not_before is not None

    # -- the check of each pass ----------------------------------------------------------------

    def undriven_claims(self) -> UndrivenClaims | None:
        """The claims held without a live driver now, as the engine record publishes them.

        ``awaiting``: no driver yet, within the grace. ``no_driver``: past the grace or with a
        driver thread that ended (the next :meth:`check` releases them), and claims whose release
        failed, until their holder has surely expired. ``None`` when there are none: the
        heartbeat then writes the record an engine without driver state writes.
        """
        now = self._registry.clock()
        awaiting: list[tuple[str, int]] = []
        without: list[tuple[str, int]] = []
        with self._lock:
            for wid, entry in self._tracked.items():
                driver = entry.driver
                if entry.queued or (driver is not None and driver.thread.is_alive()):
                    continue
                if driver is None and now - entry.since <= self._grace_ms:
                    awaiting.append((wid, entry.epoch))
                else:
                    without.append((wid, entry.epoch))
            for wid, until in list(self._left_to_expire.items()):
                if now > until:
                    del self._left_to_expire[wid]
            left = list(self._left_to_expire)
        # A claim that ended since (finished, lost) stays tracked until check() forgets it.
        held = self._registry.current_epoch
        return UndrivenClaims.of(
            [wid for wid, epoch in awaiting if held(wid) == epoch],
            [wid for wid, epoch in without if held(wid) == epoch] + left,
        )

    def check(self) -> int:
        """Give back the claims without a live driver past the grace; return how many.

        Forgets tracked claims this engine no longer holds at their epoch. Sets the
        ``weft_workflow_claims_without_driver`` gauge to the number found.
        """
        now = self._registry.clock()
        with self._lock:
            tracked = list(self._tracked.items())
        undriven: list[tuple[str, int, str]] = []
        offers: list[tuple[str, _Tracked]] = []
        for wid, entry in tracked:
            if self._registry.current_epoch(wid) != entry.epoch:
                with self._lock:
                    if self._tracked.get(wid) is entry:
                        del self._tracked[wid]
                continue
            with self._lock:
                # Judged and claimed for release in one step: a driver entering from now on is
                # refused until the release is done (see enter()), and one that entered since
                # the snapshot keeps its claim.
                reason = self._undriven_reason(wid, entry, now)
                offer = reason == _NOTHING_DROVE_IT and not entry.offered
                if offer:
                    entry.offered = True  # one offer per claim: a handler that hands it on
                elif reason is not None:
                    self._releasing.add(wid)
            if offer:
                offers.append((wid, entry))
            elif reason is not None:
                undriven.append((wid, entry.epoch, reason))
        for wid, entry in offers:
            if self._offered(wid):
                continue
            with self._lock:
                reason = self._undriven_reason(wid, entry, now)
                if reason is not None:
                    self._releasing.add(wid)
            if reason is not None:
                undriven.append((wid, entry.epoch, reason))
        self._metrics.set_claims_without_driver(len(undriven))
        for wid, epoch, reason in undriven:
            _log.warning(
                "workflow %r is held at epoch %d with no live driver for more than one renew "
                "interval (%s); its claim is released for a redrive by a handler",
                wid,
                epoch,
                reason,
            )
            try:
                self._unfinished(wid, epoch, reason)
            finally:
                with self._lock:
                    self._releasing.discard(wid)
        return len(undriven)

    def _undriven_reason(self, wid: str, entry: _Tracked, now: int) -> str | None:
        """Why ``entry`` is to be released now, or ``None``; the caller holds the lock."""
        if self._tracked.get(wid) is not entry or entry.queued:
            return None
        driver = entry.driver
        if driver is not None:
            return None if driver.thread.is_alive() else f"its {driver.kind} thread ended"
        return _NOTHING_DROVE_IT if now - entry.since > self._grace_ms else None

    def _offered(self, wid: str) -> bool:
        """Whether a handler of this engine took ``wid`` (queued to run); never raises."""
        offer = self._offer
        if offer is None:
            return False
        try:
            queued = offer(wid)
        except Exception as exc:  # the engine is closing, or the record could not be read
            _log.debug("workflow %r could not be handed to a handler here: %r", wid, exc)
            return False
        if queued:
            _log.debug(
                "workflow %r, started and not driven within its grace, is handed to its handler",
                wid,
            )
        return queued

    # -- outcomes ------------------------------------------------------------------------------

    def _finished(self, wid: str, epoch: int) -> None:
        with self._lock:
            entry = self._tracked.get(wid)
            if entry is not None and entry.epoch == epoch and entry.driver is None:
                del self._tracked[wid]
            self._attempts.pop(wid, None)
            self._not_before.pop(wid, None)
            self._last_error.pop(wid, None)

    def _unfinished(self, wid: str, epoch: int, reason: str) -> None:
        with self._lock:
            attempts = self._attempts[wid] = self._attempts.get(wid, 0) + 1
            self._last_error[wid] = reason
            entry = self._tracked.get(wid)
            if entry is not None and entry.epoch == epoch:
                del self._tracked[wid]
            if attempts < self._max_attempts:
                self._not_before[wid] = self._registry.clock() + ((attempts - 1) * self._grace_ms)
        self._metrics.record_redrive()
        if attempts >= self._max_attempts:
            self._give_up(wid, epoch, attempts, reason)
            return
        _log.warning(
            "workflow %r (epoch %d) was left unfinished: %s; its claim is released for a "
            "redrive (attempt %d of %d)",
            wid,
            epoch,
            reason,
            attempts,
            self._max_attempts,
        )
        self._release(wid, epoch)

    def _give_up(self, wid: str, epoch: int, attempts: int, reason: str) -> None:
        _log.warning(
            "workflow %r was left unfinished %d times (last: %s); it is failed",
            wid,
            attempts,
            reason,
        )
        try:
            self._dispose(
                wid, {"reason": "driver attempts exhausted", "attempts": attempts, "last": reason}
            )
        except Exception:
            _log.warning("could not fail workflow %r; releasing it", wid, exc_info=True)
            self._release(wid, epoch)
            return
        with self._lock:
            self._attempts.pop(wid, None)
            self._not_before.pop(wid, None)
            self._last_error.pop(wid, None)

    def _release(self, wid: str, epoch: int) -> None:
        try:
            if self._registry.current_epoch(wid) == epoch:
                self._registry.release(wid, expected_epoch=epoch)
        except Exception:
            # Never renewed on with no driver: forgotten here, its holder expires in the store
            # and the reclaim pass of any engine then takes it over.
            _log.warning(
                "could not release the undriven claim on workflow %r; it is left to expire",
                wid,
                exc_info=True,
            )
            self._registry.forget_local_claim(wid, expected_epoch=epoch)
            until = self._registry.clock() + self._registry.claim_ttl_ms
            with self._lock:
                if wid not in self._tracked:
                    self._left_to_expire[wid] = until
