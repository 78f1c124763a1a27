"""Child side of the chaos test: a worker that starts and drives workflows through fenced steps.

Each worker is a spawned interpreter with its own :class:`~weft_sync.Ownership` (interval
maintenance on a background thread). Its driver (the process's main thread) walks the shared list
of workflow ids in its own shuffled order and starts each one nobody has started yet; it drives
every workflow it owns through ``STEPS`` fenced steps and completes it. Workflows this engine takes
over from dead or stalled engines reach the driver through ``on_reclaimed``, which only queues
them, so the maintenance thread is never held up.

One step is one ``Workflows.fenced_write``: it stores a :class:`StepEntry` (engine, pid, the epoch
the driver held, the step, the token the registry held just before the write) under the step's
own key and advances the workflow's step counter, conditioned on the counter value just read. A
workflow whose claim was lost is dropped; right after each such deposition the worker replays one
write with the stale epoch twice, through the ledger and as a raw compare-and-swap naming the
exact stale token bytes, and journals whether the fence refused it. Two options make a worker
the host the README describes more closely: it drives inside ``Workflows.drive()`` blocks
(:attr:`ChaosConfig.drive_blocks`), and saves a checkpoint before each step, a fenced write with
no base condition (:attr:`ChaosConfig.checkpoint_steps`).

The journal says which token every claim, write and replay was made under (``token``, hex) and
when (``t0`` before the call, ``t`` after it: ``time.monotonic_ns()``, one clock for every process
of the machine), so a test can order the writes of all workers without trusting the store.

Workers talk to the test only through files (see :mod:`tests.integration.procs`): the id list, a
journal each, a "go" file every first worker waits for, and a "stop" file that ends the run. With
a rewalk file (:attr:`ChaosConfig.rewalk_path`) the worker walks the id list again whenever the
number in it grows, and starts every workflow the store does not hold (a restore of an older copy
of the store may have taken its record away).
"""

from __future__ import annotations

import contextlib
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
from weft_sync.codec import decode_epoch
from weft_sync.errors import (
    EngineDeposedError,
    FencedWriteConflict,
    StorageError,
    WorkflowClaimUnavailableError,
)
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Condition, Put
from weft_sync.workflows import WorkflowNotFoundError, WorkflowStateError

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
_OPEN_ATTEMPTS: Final = 5
_REWALK_POLL_S: Final = 0.2
"""How often the rewalk file is read."""


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
    rewalk_path: str | None = None
    """A file holding a number; when it grows, the id list is walked again (see the module)."""
    checkpoint_steps: bool = False
    """Before each step, save a checkpoint: a fenced write without a base condition."""
    drive_blocks: bool = False
    """Drive each workflow inside ``Workflows.drive()`` (else the claim awaits a driver)."""


@dataclass(frozen=True)
class StepEntry:
    """What one step of a workflow stored: who wrote it, under which epoch, which step.

    ``token`` is the hex of the fencing token the writer's registry held just before the write
    (empty for a write that named no token of the registry).
    """

    engine: str
    pid: int
    epoch: int
    step: int
    stale: bool
    token: str = ""

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
        str(fields.get("token", "")),
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


def _hex(token: bytes | None) -> str | None:
    return None if token is None else token.hex()


def _now() -> int:
    return time.monotonic_ns()


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
        # Filled by maintenance threads (on_reclaimed), drained by the driver: (id, epoch, token).
        self._reclaimed: queue.SimpleQueue[tuple[str, int | None, bytes | None]] = (
            queue.SimpleQueue()
        )
        self._retries: list[tuple[float, str]] = []
        self._ownership: Ownership | None = None
        self._deadline = time.monotonic() + config.max_duration_s
        self._ids: list[str] = []
        self._again: list[str] = []
        """Ids of the latest rewalk not looked at yet."""
        self._walked = 0
        self._next_rewalk_check = 0.0
        self._fence_token: bytes | None = None
        """The token the registry held before the driver's latest fenced write."""
        self.counts: Counter[str] = Counter()

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        log_warnings_to(self._config.log_path)
        with open(self._config.ids_path, encoding="utf-8") as handle:
            self._ids = [line for line in handle.read().split("\n") if line]
        ids = list(self._ids)
        self._rng.shuffle(ids)
        ownership = self._open()
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

    def _open(self) -> Ownership:
        """Open the engine, trying again a few times when the store cannot be reached (a
        PostgreSQL pool that did not fill within its bound on a loaded machine)."""
        attempts = 0
        while True:
            try:
                return Ownership.open(
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
            except StorageError as exc:
                attempts += 1
                if attempts == _OPEN_ATTEMPTS:
                    raise
                self._journal.write({"ev": "open_error", "error": repr(exc)})
                time.sleep(_RETRY_AFTER_S)

    def _should_stop(self) -> bool:
        # A parent that died (test timeout) never writes the stop file.
        return (
            os.path.exists(self._config.stop_path)
            or os.getppid() != self._parent
            or time.monotonic() > self._deadline
        )

    def _loop(self, ids: list[str]) -> None:
        """Drive reclaimed workflows first, then due retries, then start the next id (of the
        latest rewalk first)."""
        while not self._should_stop():
            self._maybe_rewalk()
            try:
                if ids or self._again:
                    workflow_id, epoch, token = self._reclaimed.get_nowait()
                else:
                    workflow_id, epoch, token = self._reclaimed.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                self._drive(workflow_id, epoch, token, "reclaim")
                continue
            if self._retries and self._retries[0][0] <= time.monotonic():
                _, workflow_id = self._retries.pop(0)
                self._drive(workflow_id, None, None, "retry")
            elif self._again:
                self._start_again(self._again.pop())
            elif ids:
                self._start(ids.pop())
        self.counts["stopped_by_file"] = int(os.path.exists(self._config.stop_path))

    def _maybe_rewalk(self) -> None:
        """Walk the id list again when the number in the rewalk file grew."""
        path = self._config.rewalk_path
        if path is None or time.monotonic() < self._next_rewalk_check:
            return
        self._next_rewalk_check = time.monotonic() + _REWALK_POLL_S
        try:
            with open(path, encoding="utf-8") as handle:
                generation = int(handle.read() or 0)
        except FileNotFoundError:
            return
        if generation > self._walked:
            try:
                missing = self._missing()
            except StorageError:
                return  # tried again at the next poll
            self._walked = generation
            self._rng.shuffle(missing)
            self._again = missing
            self._journal.write(
                {"ev": "rewalk", "generation": generation, "missing": len(missing), "t": _now()}
            )

    def _missing(self) -> list[str]:
        """The ids whose workflow record the store does not hold (one scan)."""
        prefix = keys.workflow("")
        present = {
            keys.decode_key_component(key[len(prefix) :])
            for key, _ in self._own.storage.scan(prefix)
            if ":" not in key[len(prefix) :]
        }
        return [wid for wid in self._ids if wid not in present]

    def _start_again(self, workflow_id: str) -> None:
        self.counts["started_again"] += 1
        self._start(workflow_id)

    # -- callbacks (maintenance threads) ---------------------------------------------------

    def _on_reclaimed(self, workflow_id: str) -> None:
        ownership = self._ownership
        # ``None`` only while Ownership.open() has not returned yet; the drive reads it again.
        registry = None if ownership is None else ownership.registry
        epoch = None if registry is None else registry.current_epoch(workflow_id)
        token = None if registry is None else registry.current_epoch_bytes(workflow_id)
        self._journal.write(
            {
                "ev": "reclaimed",
                "wf": workflow_id,
                "epoch": epoch,
                "token": _hex(token),
                "t": _now(),
            }
        )
        self._reclaimed.put((workflow_id, epoch, token))

    def _on_warning(self, warning: Warning) -> None:
        self._journal.write(
            {
                "ev": "warning",
                "kind": type(warning).__name__,
                "wf": getattr(warning, "workflow_id", None),
                "cause": getattr(warning, "cause", None),
                "t": _now(),
            }
        )

    # -- driving ---------------------------------------------------------------------------

    @property
    def _own(self) -> Ownership:
        assert self._ownership is not None
        return self._ownership

    def _start(self, workflow_id: str) -> None:
        started = _now()
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
        registry = self._own.registry
        epoch = registry.current_epoch(workflow_id)
        token = registry.current_epoch_bytes(workflow_id)
        self._journal.write(
            {
                "ev": "start",
                "wf": workflow_id,
                "epoch": epoch,
                "token": _hex(token),
                "t0": started,
                "t": _now(),
            }
        )
        self.counts["started"] += 1
        self._drive(workflow_id, epoch, token, "start")

    def _drive(
        self, workflow_id: str, expected: int | None, token: bytes | None, origin: str
    ) -> None:
        """Run the remaining steps of a workflow this engine holds, then complete it."""
        epoch = self._own.registry.current_epoch(workflow_id)
        if epoch is None or (expected is not None and epoch != expected):
            self._journal.write(
                {"ev": "not_held", "wf": workflow_id, "expected": expected, "epoch": epoch}
            )
            self.counts["not_held"] += 1
            if expected is not None and (epoch is None or epoch > expected):
                self._replay_stale(workflow_id, expected, token)
            # Either another engine owns it now, or this engine holds a newer claim, which its
            # reclaim queued again.
            return
        self._fence_token = None
        try:
            if self._config.drive_blocks:
                self._run_in_drive_block(workflow_id, epoch, origin)
            else:
                self._run_steps(workflow_id, epoch, origin)
        except EngineDeposedError:
            self.counts["deposed"] += 1
            stale = self._fence_token
            stale_epoch = decode_epoch(stale) if stale is not None else None
            self._replay_stale(workflow_id, stale_epoch or epoch, stale)
        except StorageError as exc:
            self._journal.write({"ev": "storage_error", "wf": workflow_id, "error": repr(exc)})
            self.counts["storage_error"] += 1
            self._retries.append((time.monotonic() + _RETRY_AFTER_S, workflow_id))

    def _run_in_drive_block(self, workflow_id: str, epoch: int, origin: str) -> None:
        """Run the steps inside ``Workflows.drive()``, which tells the engine they are driven."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._own.workflows.drive(workflow_id))
            except (
                WorkflowClaimUnavailableError,
                WorkflowNotFoundError,
                WorkflowStateError,
            ) as exc:
                # The claim was lost since it was looked at, and could not be claimed back.
                self._journal.write({"ev": "drive_refused", "wf": workflow_id, "error": repr(exc)})
                self.counts["drive_refused"] += 1
                return
            self._run_steps(workflow_id, epoch, origin)

    def _held_token(self, workflow_id: str) -> bytes | None:
        """The registry's token for ``workflow_id``, remembered as the one about to be fenced."""
        token = self._own.registry.current_epoch_bytes(workflow_id)
        if token is not None:
            self._fence_token = token
        return token

    def _run_steps(self, workflow_id: str, epoch: int, origin: str) -> None:
        storage = self._own.storage
        ckey = counter_key(workflow_id)
        observed = storage.get(ckey)
        step = decode_counter(observed)
        self._journal.write(
            {
                "ev": "drive",
                "wf": workflow_id,
                "epoch": epoch,
                "origin": origin,
                "step": step,
                "token": _hex(self._own.registry.current_epoch_bytes(workflow_id)),
                "t": _now(),
            }
        )
        while step < self._config.steps:
            # The step's activity.
            time.sleep(self._config.step_work_s)
            if self._config.checkpoint_steps:
                self._checkpoint(workflow_id, epoch, step)
            token = self._held_token(workflow_id)
            entry = StepEntry(
                self._config.engine_id, self._pid, epoch, step, stale=False, token=_hex(token) or ""
            )
            self._journal.write(
                {
                    "ev": "intent",
                    "wf": workflow_id,
                    "epoch": epoch,
                    "step": step,
                    "token": _hex(token),
                    "t": _now(),
                }
            )
            try:
                self._own.workflows.fenced_write(
                    workflow_id,
                    [
                        Put(step_key(workflow_id, step), entry.encode()),
                        Put(ckey, _encode_counter(step + 1)),
                    ],
                    conditions=[Condition(ckey, observed)],
                )
            except EngineDeposedError as exc:
                self._journal_deposed(workflow_id, epoch, step, exc)
                raise
            except FencedWriteConflict:
                # Without a restore only this driver writes under this epoch, so a conflict means
                # two writers; a restore of an older copy rolls the counter back under it.
                self._journal.write(
                    {"ev": "conflict", "wf": workflow_id, "step": step, "t": _now()}
                )
                self.counts["conflict"] += 1
                observed = storage.get(ckey)
                step = decode_counter(observed)
                continue
            after = self._own.registry.current_epoch_bytes(workflow_id)
            self._journal.write(
                {"ev": "ok", "wf": workflow_id, "step": step, "after": _hex(after), "t": _now()}
            )
            self.counts["step_ok"] += 1
            if self._own.registry.current_epoch(workflow_id) != epoch:
                # The claim changed hands while the write was in flight, so the entry's epoch
                # may not be the one its fence named.
                self._journal.write(
                    {
                        "ev": "ambiguous",
                        "wf": workflow_id,
                        "step": step,
                        "after": self._own.registry.current_epoch(workflow_id),
                    }
                )
            step += 1
            observed = _encode_counter(step)
        self._complete(workflow_id, epoch)

    def _checkpoint(self, workflow_id: str, epoch: int, step: int) -> None:
        """Save the step as the workflow's checkpoint: a fenced write with no base condition,
        so that nothing but the fence stands between a deposed driver and the store."""
        token = self._held_token(workflow_id)
        started = _now()
        try:
            self._own.workflows.save_checkpoint(workflow_id, b"step %d" % step)
        except EngineDeposedError as exc:
            self._journal_deposed(workflow_id, epoch, step, exc)
            raise
        after = self._own.registry.current_epoch_bytes(workflow_id)
        self._journal.write(
            {
                "ev": "checkpoint",
                "wf": workflow_id,
                "step": step,
                "token": _hex(token),
                "after": _hex(after),
                "t0": started,
                "t": _now(),
            }
        )

    def _journal_deposed(
        self, workflow_id: str, epoch: int, step: int, exc: EngineDeposedError
    ) -> None:
        at = _now()
        try:
            store = _hex(self._own.storage.get(keys.workflow_owner_epoch(workflow_id)))
        except StorageError:
            store = "?"
        self._journal.write(
            {
                "ev": "deposed",
                "wf": workflow_id,
                "epoch": epoch,
                "step": step,
                "cause": exc.cause,
                "token": _hex(self._fence_token),
                "store": store,
                "t": at,
            }
        )

    def _complete(self, workflow_id: str, epoch: int) -> None:
        result = {"engine": self._config.engine_id, "pid": self._pid, "epoch": epoch}
        token = self._held_token(workflow_id)
        started = _now()
        try:
            self._own.workflows.complete(workflow_id, result=result)
        except EngineDeposedError as exc:
            self._journal_deposed(workflow_id, epoch, self._config.steps, exc)
            raise
        except WorkflowStateError as exc:
            # Completed already: by this engine before a store error hid the success.
            self._journal.write({"ev": "not_running", "wf": workflow_id, "status": exc.status})
            self.counts["not_running"] += 1
            return
        except WorkflowNotFoundError:
            # A restore of an older copy took the record away under the claim.
            self._journal.write({"ev": "not_running", "wf": workflow_id, "status": None})
            self.counts["not_found"] += 1
            return
        self._journal.write(
            {
                "ev": "completed",
                "wf": workflow_id,
                "epoch": epoch,
                "token": _hex(token),
                "t0": started,
                "t": _now(),
            }
        )
        self.counts["completed"] += 1

    # -- stale replays ---------------------------------------------------------------------

    def _replay_stale(self, workflow_id: str, stale_epoch: int, stale_token: bytes | None) -> None:
        """Write once through the ledger and once straight to the store under a stale claim.

        The straight write names ``stale_token``, the exact bytes the lost claim was fenced on.
        """
        try:
            self._replay_stale_writes(workflow_id, stale_epoch, stale_token)
        except StorageError as exc:
            self._journal.write({"ev": "stale_error", "wf": workflow_id, "error": repr(exc)})
            self.counts["stale_error"] += 1

    def _replay_stale_writes(
        self, workflow_id: str, stale_epoch: int, stale_token: bytes | None
    ) -> None:
        storage = self._own.storage
        ckey = counter_key(workflow_id)
        registry = self._own.registry
        local = registry.current_epoch(workflow_id)
        epoch_key = keys.workflow_owner_epoch(workflow_id)
        if local is None or local == stale_epoch:
            token = registry.current_epoch_bytes(workflow_id)
            if token is not None and storage.get(epoch_key) == token:
                # The registry still holds the token the store holds (this engine released the
                # claim itself, and no one took it since): a write under it is not stale.
                self._record_stale(workflow_id, stale_epoch, "ledger", "inconclusive", local=local)
            else:
                self._replay_through_ledger(workflow_id, stale_epoch, local, token)
        current = storage.get(epoch_key)
        if stale_token is None or current is None or current == stale_token:
            self._record_stale(
                workflow_id,
                stale_epoch,
                "store",
                "inconclusive",
                local=local,
                store=_hex(current),
            )
            return
        observed = storage.get(ckey)
        step = decode_counter(observed)
        started = _now()
        committed = storage.conditional_batch(
            [Condition(epoch_key, stale_token), Condition(ckey, observed)],
            [
                Put(
                    step_key(workflow_id, step),
                    self._stale_entry(stale_epoch, step, stale_token).encode(),
                ),
                Put(ckey, _encode_counter(step + 1)),
            ],
        )
        self._record_stale(
            workflow_id,
            stale_epoch,
            "store",
            "accepted" if committed else "refused",
            local=local,
            store_epoch=decode_epoch(current),
            store=current.hex(),
            token=stale_token.hex(),
            step=step,
            t0=started,
            t=_now(),
        )

    def _replay_through_ledger(
        self, workflow_id: str, stale_epoch: int, local: int | None, token: bytes | None
    ) -> None:
        ckey = counter_key(workflow_id)
        observed = self._own.storage.get(ckey)
        entry = self._stale_entry(stale_epoch, decode_counter(observed), token)
        started = _now()
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
        self._record_stale(
            workflow_id,
            stale_epoch,
            "ledger",
            outcome,
            local=local,
            token=_hex(token),
            step=entry.step,
            t0=started,
            t=_now(),
        )

    def _stale_entry(self, epoch: int, step: int, token: bytes | None) -> StepEntry:
        return StepEntry(
            self._config.engine_id, self._pid, epoch, step, stale=True, token=_hex(token) or ""
        )

    def _record_stale(
        self, workflow_id: str, epoch: int, via: str, outcome: str, **extra: Any
    ) -> None:
        self._journal.write(
            {"ev": "stale", "wf": workflow_id, "epoch": epoch, "via": via, "outcome": outcome}
            | extra
        )
        self.counts[f"stale_{via}_{outcome}"] += 1
