"""Durable updates: any process queues an update; the owner's handler receives each one once.

An update is one key, ``wf:<id>:update:<seq>``, written in a compare-and-swap conditioned on the
workflow record's exact bytes (so it is never queued for a missing or finished workflow). The
owner-side update poll drains the queue of every held workflow that has a handler, oldest first:
the handler runs, then a fenced delete conditioned on the update's bytes removes it. A handler
that raises leaves its update (and every later one) queued for the next poll, so order is kept.

Delivery is once per owner: only an engine whose fence still holds removes an update. If the
owner dies (or is deposed) after a handler returned but before its delete committed, the next
owner receives that update again, so handlers should be idempotent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from .. import keys
from ..clock import Clock
from ..maintenance.polls import SignalWakeDecision
from ..storage.base import Condition, Delete, Put, Storage, storage_conditional_batch
from .fenced_writes import Fence
from .records import (
    ExternalCommitConflictError,
    decode_payload_map,
    new_sequence,
    pack_payload,
    update_prefix,
    validate_name,
)
from .signals import require_active_record

_log = logging.getLogger(__name__)

SUBMIT_MAX_ATTEMPTS: Final = 5
"""Compare-and-swap attempts of one submit before the record is judged too busy."""


@dataclass(frozen=True, slots=True)
class WorkflowUpdate:
    """One update handed to the owner's handler.

    ``update_id`` is unique per update and stable across redeliveries.
    """

    workflow_id: str
    name: str
    payload: Any
    submitted_at: int
    update_id: str


UpdateHandler = Callable[[WorkflowUpdate], object]
"""Receives one update; raising leaves it queued for the next poll."""


class UpdateQueue:
    """Queues updates and delivers them to the owner's handlers.

    :param storage: the shared store.
    :param fence: commits the owner's fenced deletes and runs the wake-ownership check.
    :param clock: stamps ``submitted_at`` and orders update keys.
    """

    def __init__(self, storage: Storage, fence: Fence, clock: Clock) -> None:
        self._storage = storage
        self._fence = fence
        self._clock = clock
        # _lock guards _handlers and _draining (ids whose queue a thread is draining now).
        self._lock = threading.Lock()
        self._handlers: dict[str, UpdateHandler] = {}
        self._draining: set[str] = set()

    def submit(self, workflow_id: str, name: str, payload: Any) -> str:
        """Queue one update durably; return its ``update_id``.

        :raises WorkflowNotFoundError: the workflow does not exist.
        :raises WorkflowStateError: it has finished.
        :raises ValueError: ``payload`` cannot be stored as MessagePack.
        :raises ExternalCommitConflictError: the record changed under every attempt.
        """
        validate_name("update name", name)
        for _ in range(SUBMIT_MAX_ATTEMPTS):
            record_bytes, _record = require_active_record(self._storage, workflow_id, "update")
            now = self._clock()
            value = pack_payload(
                f"the payload of update {name!r}",
                {"name": name, "payload": payload, "submitted_at": now},
            )
            update_id = new_sequence(now)
            key = update_prefix(workflow_id) + update_id
            conditions = [Condition(keys.workflow(workflow_id), record_bytes)]
            if storage_conditional_batch(self._storage, conditions, [Put(key, value)]):
                _log.debug("queued update %r (%s) for workflow %r", name, update_id, workflow_id)
                return update_id
        raise ExternalCommitConflictError(workflow_id, "update", SUBMIT_MAX_ATTEMPTS)

    def set_handler(self, workflow_id: str, handler: UpdateHandler | None) -> None:
        """Register (or with ``None`` remove) the handler of ``workflow_id``'s updates."""
        if handler is not None and not callable(handler):
            raise TypeError(
                f"an update handler must be callable with one WorkflowUpdate, got {handler!r}"
            )
        with self._lock:
            if handler is None:
                self._handlers.pop(workflow_id, None)
            else:
                self._handlers[workflow_id] = handler

    def held_with_handlers(self) -> list[str]:
        """Ids this engine holds that have a handler (the ones the poll drains)."""
        registry = self._fence.optional_registry()
        if registry is None:
            return []
        with self._lock:
            handled = set(self._handlers)
        return [w for w in registry.list_held_workflow_ids() if w in handled]

    def has_pending(self, workflow_id: str) -> bool:
        """Whether at least one update is queued (does not consume it)."""
        return bool(self._storage.scan(update_prefix(workflow_id), limit=1))

    def drain(self, workflow_id: str) -> int:
        """Deliver the queued updates of ``workflow_id``, oldest first; return how many.

        Nothing is delivered without a handler, while another thread drains the same workflow,
        or when the wake-ownership check finds this engine no longer owns it.

        :raises Exception: what the handler raised (that update and later ones stay queued).
        :raises EngineDeposedError: the claim was lost while draining.
        """
        with self._lock:
            handler = self._handlers.get(workflow_id)
            if handler is None or workflow_id in self._draining:
                return 0
            self._draining.add(workflow_id)
        try:
            if self._fence.confirm_wake(workflow_id, "update") is SignalWakeDecision.DISCARD:
                return 0
            return self._deliver_all(workflow_id, handler)
        finally:
            with self._lock:
                self._draining.discard(workflow_id)

    def _deliver_all(self, workflow_id: str, handler: UpdateHandler) -> int:
        delivered = 0
        prefix = update_prefix(workflow_id)
        for key, raw in self._storage.scan(prefix):
            data = decode_payload_map(raw)
            name = None if data is None else data.get("name")
            submitted_at = None if data is None else data.get("submitted_at")
            if data is None or not isinstance(name, str) or not isinstance(submitted_at, int):
                _log.warning("dropping an undecodable update %r of workflow %r", key, workflow_id)
                self._fence.commit(workflow_id, [Condition(key, raw)], [Delete(key)])
                continue
            update = WorkflowUpdate(
                workflow_id, name, data.get("payload"), submitted_at, key[len(prefix) :]
            )
            handler(update)
            if self._fence.commit(workflow_id, [Condition(key, raw)], [Delete(key)]):
                delivered += 1
            else:
                _log.debug("update %r of workflow %r was already removed", key, workflow_id)
        return delivered

    def forget(self, workflow_id: str) -> None:
        """Drop the handler of a workflow that finished."""
        with self._lock:
            self._handlers.pop(workflow_id, None)

    def after_fork_in_child(self) -> None:
        """Forget the parent's handlers and drains: a forked child starts holding nothing."""
        self._lock = threading.Lock()
        self._handlers = {}
        self._draining = set()
