"""Child side of the chaos test: a worker that starts and drives workflows through fenced steps.

Each worker is a spawned interpreter with its own :class:`~weft_sync.Ownership` (interval
maintenance on a background thread). Its driver (the process's main thread) walks the shared list
of workflow ids in its own shuffled order and starts each one nobody has started yet; it drives
every workflow it owns through ``STEPS`` fenced steps and completes it. Workflows this engine takes
over from dead or stalled engines reach the driver through ``on_reclaimed``, which only queues
them, so the maintenance thread is never held up.

One step is one ``Workflows.fenced_write``: it stores a :class:`StepEntry` (engine, pid, the epoch
the driver held, the step) under the step's own key and advances the workflow's step counter,
conditioned on the counter value just read. A workflow whose claim was lost is dropped; right
after each such deposition the worker replays one write with the stale epoch twice, through the
ledger and as a raw compare-and-swap naming the stale epoch bytes, and journals whether the
fence refused it.

Workers talk to the test only through files (see :mod:`tests.integration.procs`): the id list, a
journal each, a "go" file every first worker waits for, and a "stop" file that ends the run.
"""

from __future__ import annotations

import json
import os
import queue
import random
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Final

from tests.integration.procs import Journal, log_warnings_to, run_journaled, wait_for_go
from weft_sync import keys
from weft_sync.codec import decode_epoch, encode_epoch
from weft_sync.errors import (
    EngineDeposedError,
    FencedWriteConflict,
    StorageError,
    WorkflowClaimUnavailableError,
)
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Condition, Put
from weft_sync.workflows import WorkflowStateError

__all__ = [
    "WORKFLOW_TYPE",
    "ChaosConfig",
    "StepEntry",
    "counter_key",
    "decode_counter",
    "decode_step_entry",
    "run_worker",
    "step_key",
    "step_prefix",
]

WORKFLOW_TYPE: Final = "chaos"
_POLL_S: Final = 0.02
_GO_TIMEOUT_S: Final = 120.0
_CLOSE_TIMEOUT_S: Final = 10.0
_RETRY_AFTER_S: Final = 0.2
"""Delay before a drive that failed on a store error is tried again."""


@dataclass(frozen=True)
class ChaosConfig:
    """Everything one worker incarnation needs (pickled across the ``spawn`` boundary)."""

    storage_url: str
    engine_id: str
    ids_path: str
    journal_path: str
    log_path: str
    go_path: str
    stop_path: str
    steps: int
    step_work_s: float
    claim_ttl_ms: int
    claim_renew_interval_ms: int
    seed: int
    max_duration_s: float


@dataclass(frozen=True)
class StepEntry:
    """What one step of a workflow stored: who wrote it, under which epoch, which step."""

    engine: str
    pid: int
    epoch: int
    step: int
    stale: bool

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def decode_step_entry(raw: bytes) -> StepEntry:
    """Parse a stored step entry."""
    fields = json.loads(raw)
    return StepEntry(
        str(fields["engine"]),
        int(fields["pid"]),
        int(fields["epoch"]),
        int(fields["step"]),
        bool(fields["stale"]),
    )


def counter_key(workflow_id: str) -> str:
    """The key of ``workflow_id``'s step counter (the number of steps done)."""
    return "chaos-counter:" + keys.encode_key_component(workflow_id)


def step_prefix(workflow_id: str) -> str:
    """The prefix shared by every step entry of ``workflow_id``."""
    return "chaos-step:" + keys.encode_key_component(workflow_id) + ":"


def step_key(workflow_id: str, step: int) -> str:
    """The key of step ``step`` (0-based) of ``workflow_id``."""
    return f"{step_prefix(workflow_id)}{step:04d}"


def decode_counter(raw: bytes | None) -> int:
    """The step count a counter value records; an absent counter means no step done."""
    if raw is None:
        return 0
    (count,) = struct.unpack(">Q", raw)
    return int(count)


def _encode_counter(count: int) -> bytes:
    return struct.pack(">Q", count)


def run_worker(config: ChaosConfig) -> None:
    """Entry point of a worker process; journals a traceback before re-raising any error."""
    run_journaled(config.journal_path, lambda journal: _Worker(config, journal).run())


class _Worker:
    """One worker incarnation: an engine, its driver loop and its journal."""

    def __init__(self, config: ChaosConfig, journal: Journal) -> None:
        self._config = config
        self._journal = journal
        self._pid = os.getpid()
        self._parent = os.getppid()
        self._rng = random.Random(config.seed)
        # Filled by maintenance threads (on_reclaimed), drained by the driver.
        self._reclaimed: queue.SimpleQueue[tuple[str, int | None]] = queue.SimpleQueue()
        self._retries: list[tuple[float, str]] = []
        self._ownership: Ownership | None = None
        self._deadline = time.monotonic() + config.max_duration_s
        self.counts: Counter[str] = Counter()

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        log_warnings_to(self._config.log_path)
        with open(self._config.ids_path, encoding="utf-8") as handle:
            ids = [line for line in handle.read().split("\n") if line]
        self._rng.shuffle(ids)
        ownership = Ownership.open(
            self._config.storage_url,
            options=OwnershipOptions(
                claim_ttl=self._config.claim_ttl_ms,
                claim_renew_interval=self._config.claim_renew_interval_ms,
            ),
            on_reclaimed=self._on_reclaimed,
            background="thread",
            warn=self._on_warning,
            engine_id=self._config.engine_id,
        )
        self._ownership = ownership
        self._journal.write({"ev": "ready", "pid": self._pid, "engine": ownership.engine_id})
        try:
            wait_for_go(self._config.go_path, _GO_TIMEOUT_S, _POLL_S)
            self._loop(ids)
        finally:
            ownership.close(timeout=_CLOSE_TIMEOUT_S)
        self._journal.write(
            {
                "ev": "summary",
                "counts": dict(self.counts),
                "attempts": ownership.metrics.snapshot().attempts,
            }
        )

    def _should_stop(self) -> bool:
        # A parent that died (test timeout) never writes the stop file.
        return (
            os.path.exists(self._config.stop_path)
            or os.getppid() != self._parent
            or time.monotonic() > self._deadline
        )

    def _loop(self, ids: list[str]) -> None:
        """Drive reclaimed workflows first, then due retries, then start the next id."""
        while not self._should_stop():
            try:
                if ids:
                    workflow_id, epoch = self._reclaimed.get_nowait()
                else:
                    workflow_id, epoch = self._reclaimed.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                self._drive(workflow_id, epoch, "reclaim")
                continue
            if self._retries and self._retries[0][0] <= time.monotonic():
                _, workflow_id = self._retries.pop(0)
                self._drive(workflow_id, None, "retry")
            elif ids:
                self._start(ids.pop())
        self.counts["stopped_by_file"] = int(os.path.exists(self._config.stop_path))

    # -- callbacks (maintenance threads) ---------------------------------------------------

    def _on_reclaimed(self, workflow_id: str) -> None:
        ownership = self._ownership
        # ``None`` only while Ownership.open() has not returned yet; the drive reads it again.
        epoch = None if ownership is None else ownership.registry.current_epoch(workflow_id)
        self._journal.write({"ev": "reclaimed", "wf": workflow_id, "epoch": epoch})
        self._reclaimed.put((workflow_id, epoch))

    def _on_warning(self, warning: Warning) -> None:
        self._journal.write(
            {
                "ev": "warning",
                "kind": type(warning).__name__,
                "wf": getattr(warning, "workflow_id", None),
            }
        )

    # -- driving ---------------------------------------------------------------------------

    @property
    def _own(self) -> Ownership:
        assert self._ownership is not None
        return self._ownership

    def _start(self, workflow_id: str) -> None:
        try:
            self._own.workflows.start(
                workflow_id,
                WORKFLOW_TYPE,
                input={"engine": self._config.engine_id, "pid": self._pid},
            )
        except WorkflowClaimUnavailableError:
            self.counts["start_skipped"] += 1
            return
        except StorageError as exc:
            # Whether it committed is unknown: if it did, the claim expires unrenewed and a
            # reclaim pass (maybe this engine's) drives the workflow.
            self._journal.write({"ev": "start_error", "wf": workflow_id, "error": repr(exc)})
            self.counts["start_error"] += 1
            return
        epoch = self._own.registry.current_epoch(workflow_id)
        self._journal.write({"ev": "start", "wf": workflow_id, "epoch": epoch})
        self.counts["started"] += 1
        self._drive(workflow_id, epoch, "start")

    def _drive(self, workflow_id: str, expected: int | None, origin: str) -> None:
        """Run the remaining steps of a workflow this engine holds, then complete it."""
        epoch = self._own.registry.current_epoch(workflow_id)
        if epoch is None or (expected is not None and epoch != expected):
            self._journal.write(
                {"ev": "not_held", "wf": workflow_id, "expected": expected, "epoch": epoch}
            )
            self.counts["not_held"] += 1
            if expected is not None and (epoch is None or epoch > expected):
                self._replay_stale(workflow_id, expected)
            # Either another engine owns it now, or this engine holds a newer claim, which its
            # reclaim queued again.
            return
        try:
            self._run_steps(workflow_id, epoch, origin)
        except EngineDeposedError:
            self.counts["deposed"] += 1
            self._replay_stale(workflow_id, epoch)
        except StorageError as exc:
            self._journal.write({"ev": "storage_error", "wf": workflow_id, "error": repr(exc)})
            self.counts["storage_error"] += 1
            self._retries.append((time.monotonic() + _RETRY_AFTER_S, workflow_id))

    def _run_steps(self, workflow_id: str, epoch: int, origin: str) -> None:
        storage = self._own.storage
        ckey = counter_key(workflow_id)
        observed = storage.get(ckey)
        step = decode_counter(observed)
        self._journal.write(
            {"ev": "drive", "wf": workflow_id, "epoch": epoch, "origin": origin, "step": step}
        )
        while step < self._config.steps:
            # The step's activity.
            time.sleep(self._config.step_work_s)
            entry = StepEntry(self._config.engine_id, self._pid, epoch, step, stale=False)
            self._journal.write({"ev": "intent", "wf": workflow_id, "epoch": epoch, "step": step})
            try:
                self._own.workflows.fenced_write(
                    workflow_id,
                    [
                        Put(step_key(workflow_id, step), entry.encode()),
                        Put(ckey, _encode_counter(step + 1)),
                    ],
                    conditions=[Condition(ckey, observed)],
                )
            except EngineDeposedError:
                self._journal.write(
                    {"ev": "deposed", "wf": workflow_id, "epoch": epoch, "step": step}
                )
                raise
            except FencedWriteConflict:
                # Only this driver writes under this epoch: a conflict means two writers.
                self._journal.write({"ev": "conflict", "wf": workflow_id, "step": step})
                self.counts["conflict"] += 1
                observed = storage.get(ckey)
                step = decode_counter(observed)
                continue
            self._journal.write({"ev": "ok", "wf": workflow_id, "step": step})
            self.counts["step_ok"] += 1
            after = self._own.registry.current_epoch(workflow_id)
            if after != epoch:
                # The claim changed hands while the write was in flight, so the entry's epoch
                # may not be the one its fence named.
                self._journal.write(
                    {"ev": "ambiguous", "wf": workflow_id, "step": step, "after": after}
                )
            step += 1
            observed = _encode_counter(step)
        self._complete(workflow_id, epoch)

    def _complete(self, workflow_id: str, epoch: int) -> None:
        result = {"engine": self._config.engine_id, "pid": self._pid, "epoch": epoch}
        try:
            self._own.workflows.complete(workflow_id, result=result)
        except EngineDeposedError:
            self._journal.write(
                {"ev": "deposed", "wf": workflow_id, "epoch": epoch, "step": self._config.steps}
            )
            raise
        except WorkflowStateError as exc:
            # Completed already: by this engine before a store error hid the success.
            self._journal.write({"ev": "not_running", "wf": workflow_id, "status": exc.status})
            self.counts["not_running"] += 1
            return
        self._journal.write({"ev": "completed", "wf": workflow_id, "epoch": epoch})
        self.counts["completed"] += 1

    # -- stale replays ---------------------------------------------------------------------

    def _replay_stale(self, workflow_id: str, stale_epoch: int) -> None:
        """Write once through the ledger and once straight to the store under ``stale_epoch``."""
        try:
            self._replay_stale_writes(workflow_id, stale_epoch)
        except StorageError as exc:
            self._journal.write({"ev": "stale_error", "wf": workflow_id, "error": repr(exc)})
            self.counts["stale_error"] += 1

    def _replay_stale_writes(self, workflow_id: str, stale_epoch: int) -> None:
        storage = self._own.storage
        ckey = counter_key(workflow_id)
        local = self._own.registry.current_epoch(workflow_id)
        if local is None or local == stale_epoch:
            observed = storage.get(ckey)
            entry = self._stale_entry(stale_epoch, decode_counter(observed))
            try:
                self._own.workflows.fenced_write(
                    workflow_id,
                    [Put(step_key(workflow_id, entry.step), entry.encode())],
                    conditions=[Condition(ckey, observed)],
                )
                outcome = "accepted"
            except EngineDeposedError:
                outcome = "refused"
            except FencedWriteConflict:
                outcome = "inconclusive"
            self._record_stale(workflow_id, stale_epoch, "ledger", outcome, local=local)
        store_epoch = decode_epoch(storage.get(keys.workflow_owner_epoch(workflow_id)))
        if store_epoch is None or store_epoch <= stale_epoch:
            self._record_stale(workflow_id, stale_epoch, "store", "inconclusive", local=local)
            return
        observed = storage.get(ckey)
        step = decode_counter(observed)
        committed = storage.conditional_batch(
            [
                Condition(keys.workflow_owner_epoch(workflow_id), encode_epoch(stale_epoch)),
                Condition(ckey, observed),
            ],
            [
                Put(step_key(workflow_id, step), self._stale_entry(stale_epoch, step).encode()),
                Put(ckey, _encode_counter(step + 1)),
            ],
        )
        self._record_stale(
            workflow_id,
            stale_epoch,
            "store",
            "accepted" if committed else "refused",
            local=local,
            store_epoch=store_epoch,
        )

    def _stale_entry(self, epoch: int, step: int) -> StepEntry:
        return StepEntry(self._config.engine_id, self._pid, epoch, step, stale=True)

    def _record_stale(
        self, workflow_id: str, epoch: int, via: str, outcome: str, **extra: Any
    ) -> None:
        self._journal.write(
            {"ev": "stale", "wf": workflow_id, "epoch": epoch, "via": via, "outcome": outcome}
            | extra
        )
        self.counts[f"stale_{via}_{outcome}"] += 1
