"""One engine of the fleet test, in its own spawned interpreter.

Every engine registers a handler for the ``fleet-job`` type that journals each drive (workflow
id, epoch) and saves a checkpoint naming the engine, a fenced write that only the owner of the
epoch can make. The victim starts the fleet's workflows before it journals ``ready`` and is then
SIGKILLed by the test.

Variants: ``scan`` discovers by the full scan (the fallback) and ``lockless`` runs on a store
wrapper that hides the session-lock capability, so its liveness is its heartbeat alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tests.integration.procs import Journal, log_warnings_to, run_journaled
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow
from weft_sync.errors import WorkflowClaimUnavailableError
from weft_sync.storage import (
    Batch,
    Condition,
    Operation,
    Storage,
    StorageCapabilities,
    open_storage,
)

JOB_TYPE = "fleet-job"
STOP_POLL_S = 0.05


@dataclass(frozen=True)
class FleetEngine:
    """What one fleet process runs."""

    name: str
    url: str
    journal: str
    log: str
    go: str
    stop: str
    workflows: Sequence[str] = ()
    variant: str = "auto"  # "auto" | "scan" | "lockless"
    claim_ttl_ms: int = 60_000
    renew_ms: int = 1_000


class LocklessStore:
    """A store that forwards the storage contract only: no session locks, no bulk extras."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    @property
    def capabilities(self) -> StorageCapabilities:
        return dataclasses.replace(self._inner.capabilities, session_locks=False)

    def get(self, key: str) -> bytes | None:
        return self._inner.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._inner.put(key, value)

    def delete(self, key: str) -> None:
        self._inner.delete(key)

    def scan(self, prefix: str, **bounds: object) -> list[tuple[str, bytes]]:
        return self._inner.scan(prefix, **bounds)  # type: ignore[arg-type]

    def batch(self, operations: Sequence[Operation]) -> None:
        self._inner.batch(operations)

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        return self._inner.conditional_batch(conditions, operations)

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        return self._inner.conditional_batches(batches)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> LocklessStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _drive_held(ownership: Ownership, ids: Sequence[str]) -> None:
    """Make this thread the driver of each claim of ``ids`` held and not driven elsewhere now."""
    held = set(ownership.registry.list_held_workflow_ids())
    for wid in [w for w in ids if w in held]:
        epoch = ownership.registry.current_epoch(wid)
        if epoch is None:
            continue
        with contextlib.suppress(WorkflowClaimUnavailableError):
            ownership.drivers.enter(wid, epoch, "fleet engine loop")


def run_engine(config: FleetEngine) -> None:
    """The body of one fleet process."""
    log_warnings_to(config.log)
    run_journaled(config.journal, lambda journal: _run(config, journal))


def _run(config: FleetEngine, journal: Journal) -> None:
    options = OwnershipOptions(
        claim_ttl=config.claim_ttl_ms,
        claim_renew_interval=config.renew_ms,
        reclaim_discovery="scan" if config.variant == "scan" else "auto",
    )
    store: Storage = open_storage(config.url)
    if config.variant == "lockless":
        store = LocklessStore(store)

    resumed: list[str] = []  # appended to by handler threads (list.append is atomic)

    def drive(ctx: ReclaimedWorkflow) -> None:
        journal.write({"ev": "drive", "id": ctx.workflow_id, "epoch": ctx.epoch})
        ctx.workflows.save_checkpoint(ctx.workflow_id, config.name.encode())
        resumed.append(ctx.workflow_id)  # handed on to the engine's own loop below

    try:
        with Ownership.open(store, options=options, handlers={JOB_TYPE: drive}) as ownership:
            for workflow_id in config.workflows:
                ownership.workflows.start(workflow_id, JOB_TYPE)
            _drive_held(ownership, config.workflows)
            journal.write({"ev": "ready", "engine": ownership.engine_id})
            deadline = time.monotonic() + 600
            while not os.path.exists(config.stop):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the go file {config.stop!r} never appeared")
                # The engine's own loop drives what it started and what its handler resumed.
                _drive_held(ownership, [*config.workflows, *resumed])
                time.sleep(STOP_POLL_S)
    finally:
        store.close()
