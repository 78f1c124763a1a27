"""Durable signals: any process buffers a signal; only the workflow's owner consumes it.

A signal is one key, ``wf:<id>:signal:<enc(name)>:<seq>``, written in a compare-and-swap that is
conditioned on the workflow record's exact bytes, so a signal is never buffered for a workflow
that does not exist or has finished. The owner consumes the oldest signal of a name with a fenced
delete conditioned on that signal's bytes: of any number of consumers, exactly one delete
commits, and a deposed engine's delete fails at the store.

A waiter parks on a :class:`threading.Event`. It is woken directly when this process sends the
signal, and by the owner-side signal poll (``wake``) when another process did; the poll wakes it
only after the wake-ownership check.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from .. import keys
from ..clock import Clock
from ..codec import WorkflowRecord
from ..maintenance.polls import SignalWakeDecision
from ..maintenance.targets import ParkedSignalWait
from ..storage.base import Condition, Delete, Put, Storage, storage_conditional_batch
from .fenced_writes import Fence
from .records import (
    ACTIVE_STATUSES,
    ExternalCommitConflictError,
    WorkflowNotFoundError,
    WorkflowStateError,
    decode_payload_map,
    new_sequence,
    pack_payload,
    read_record,
    signal_prefix,
    validate_name,
)

_log = logging.getLogger(__name__)

SEND_MAX_ATTEMPTS: Final = 5
"""Compare-and-swap attempts of one send before the record is judged too busy."""


@dataclass(eq=False, slots=True)
class _Waiter:
    """One thread parked in :meth:`SignalBuffer.wait`; compared by identity."""

    workflow_id: str
    name: str
    event: threading.Event = field(default_factory=threading.Event)


def require_active_record(
    storage: Storage, workflow_id: str, operation: str
) -> tuple[bytes, WorkflowRecord]:
    """Read the record and insist it is pending, running or suspended.

    :raises WorkflowNotFoundError: no record.
    :raises WorkflowStateError: the workflow has finished.
    """
    found = read_record(storage, workflow_id)
    if found is None:
        raise WorkflowNotFoundError(workflow_id)
    if found[1].status not in ACTIVE_STATUSES:
        raise WorkflowStateError(workflow_id, found[1].status, operation, ACTIVE_STATUSES)
    return found


class SignalBuffer:
    """Buffers, consumes and wakes durable signals.

    :param storage: the shared store.
    :param fence: commits the owner's fenced deletes and runs the wake-ownership check.
    :param clock: stamps ``sent_at`` and orders signal keys.
    """

    def __init__(self, storage: Storage, fence: Fence, clock: Clock) -> None:
        self._storage = storage
        self._fence = fence
        self._clock = clock
        # _lock guards _waiters (workflow id -> parked waiters). Only Event.set runs under it.
        self._lock = threading.Lock()
        self._waiters: dict[str, list[_Waiter]] = {}

    # -- any process -------------------------------------------------------------------------

    def send(self, workflow_id: str, name: str, payload: Any) -> None:
        """Buffer one signal durably and wake this process's waiters for it.

        :raises WorkflowNotFoundError: the workflow does not exist.
        :raises WorkflowStateError: it has finished.
        :raises ValueError: ``payload`` cannot be stored as MessagePack.
        :raises ExternalCommitConflictError: the record changed under every attempt.
        """
        validate_name("signal name", name)
        for _ in range(SEND_MAX_ATTEMPTS):
            record_bytes, _record = require_active_record(self._storage, workflow_id, "signal")
            now = self._clock()
            value = pack_payload(
                f"the payload of signal {name!r}", {"payload": payload, "sent_at": now}
            )
            key = signal_prefix(workflow_id, name) + new_sequence(now)
            conditions = [Condition(keys.workflow(workflow_id), record_bytes)]
            if storage_conditional_batch(self._storage, conditions, [Put(key, value)]):
                _log.debug("buffered signal %r for workflow %r", name, workflow_id)
                self._notify(workflow_id, name)
                return
        raise ExternalCommitConflictError(workflow_id, "signal", SEND_MAX_ATTEMPTS)

    def has_buffered(self, workflow_id: str, name: str) -> bool:
        """Whether at least one signal ``name`` is buffered (does not consume it)."""
        return bool(self._storage.scan(signal_prefix(workflow_id, name), limit=1))

    # -- the owner ---------------------------------------------------------------------------

    def wait(self, workflow_id: str, name: str, timeout: float) -> Any:
        """Consume one signal ``name``, parking up to ``timeout`` seconds until one arrives.

        :raises EngineDeposedError: this engine does not (or no longer) own the workflow.
        :raises TimeoutError: no signal arrived in time (nothing was consumed).
        """
        validate_name("signal name", name)
        seconds = _check_timeout(timeout)
        self._fence.fence_bytes(workflow_id)
        deadline = time.monotonic() + seconds
        waiter = _Waiter(workflow_id, name)
        with self._lock:
            self._waiters.setdefault(workflow_id, []).append(waiter)
        try:
            while True:
                # Cleared before probing, so a wake arriving after the probe is not lost.
                waiter.event.clear()
                found, payload = self._consume_one(workflow_id, name)
                if found:
                    return payload
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no signal {name!r} arrived for workflow {workflow_id!r} within "
                        f"{seconds} s; nothing was consumed"
                    )
                waiter.event.wait(remaining)
        finally:
            self._unregister(waiter)

    def _consume_one(self, workflow_id: str, name: str) -> tuple[bool, Any]:
        prefix = signal_prefix(workflow_id, name)
        while True:
            # Checked on every round: an engine that lost the claim stops waiting at once.
            self._fence.fence_bytes(workflow_id)
            rows = self._storage.scan(prefix, limit=1)
            if not rows:
                return False, None
            key, raw = rows[0]
            if not self._fence.commit(workflow_id, [Condition(key, raw)], [Delete(key)]):
                continue  # another consumer of this engine took it; look again
            data = decode_payload_map(raw)
            if data is None:
                _log.warning("dropped an undecodable signal %r of workflow %r", key, workflow_id)
                continue
            _log.debug("consumed signal %r of workflow %r", name, workflow_id)
            return True, data.get("payload")

    # -- the signal poll ---------------------------------------------------------------------

    def parked_waits(self) -> list[ParkedSignalWait]:
        """The distinct ``(workflow, signal)`` waits parked here, for workflows still held."""
        with self._lock:
            pairs = {(w.workflow_id, w.name): None for ws in self._waiters.values() for w in ws}
        registry = self._fence.optional_registry()
        if registry is None:
            return []
        return [
            ParkedSignalWait(workflow_id, name)
            for workflow_id, name in pairs
            if registry.current_epoch(workflow_id) is not None
        ]

    def wake(self, workflow_id: str) -> None:
        """Wake the waiters of ``workflow_id`` whose own signal is buffered, if still owned.

        Each waiter's signal is re-probed, so a waiter whose signal never arrived is not woken.
        A wake this engine no longer owns is discarded with a wake-discarded warning. Unknown
        ids are a no-op.
        """
        with self._lock:
            names = {w.name for w in self._waiters.get(workflow_id, ())}
        buffered = {name for name in names if self.has_buffered(workflow_id, name)}
        if not buffered:
            return
        if self._fence.confirm_wake(workflow_id, "signal") is SignalWakeDecision.DISCARD:
            return
        self._notify(workflow_id, *buffered)

    def notify_all(self, workflow_id: str) -> None:
        """Wake every waiter of ``workflow_id`` so it re-checks its claim (after a transition)."""
        with self._lock:
            for waiter in self._waiters.get(workflow_id, ()):
                waiter.event.set()

    def _notify(self, workflow_id: str, *names: str) -> None:
        with self._lock:
            for waiter in self._waiters.get(workflow_id, ()):
                if waiter.name in names:
                    waiter.event.set()

    def after_fork_in_child(self) -> None:
        """Forget the parent's waiters (their threads do not exist in a forked child)."""
        self._lock = threading.Lock()
        self._waiters = {}

    def _unregister(self, waiter: _Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.workflow_id, [])
            remaining = [w for w in waiters if w is not waiter]
            if remaining:
                self._waiters[waiter.workflow_id] = remaining
            else:
                self._waiters.pop(waiter.workflow_id, None)


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)
