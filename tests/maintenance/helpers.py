"""Test doubles for the maintenance layer: a scheduler fired by hand, fake targets, gauges.

The fakes implement the target protocols with plain Python state; they stand in for the host
and the registry adapters, never for storage. The workflow-record writers at the end put real
records into a real store, as a host's ledger would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from weft_sync import keys
from weft_sync.codec import WorkflowRecord, encode_workflow_record
from weft_sync.maintenance.targets import ParkedSignalWait, PassKind, PassResult
from weft_sync.metrics import ClaimMetrics
from weft_sync.storage import Storage

WAIT_S = 10.0
"""Upper bound for any wait in these tests; reaching it means the test failed."""


class ManualScheduler:
    """An :class:`IntervalScheduler` whose ticks fire only when a test calls :meth:`fire`."""

    def __init__(self) -> None:
        # _lock guards _callbacks, _next, set_calls and cleared.
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 1
        self.set_calls: list[int] = []
        self.cleared: list[object] = []

    def set_interval(self, callback: Callable[[], None], interval_ms: int) -> int:
        with self._lock:
            handle = self._next
            self._next += 1
            self._callbacks[handle] = callback
            self.set_calls.append(interval_ms)
            return handle

    def clear_interval(self, handle: object) -> None:
        with self._lock:
            self.cleared.append(handle)
            if isinstance(handle, int):
                self._callbacks.pop(handle, None)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def callbacks(self) -> list[Callable[[], None]]:
        with self._lock:
            return list(self._callbacks.values())

    def fire(self) -> None:
        """Run every armed callback once, on the calling thread."""
        for callback in self.callbacks():
            callback()


class Gauge:
    """Counts calls in progress and remembers the peak."""

    def __init__(self) -> None:
        # _cond guards current and peak.
        self._cond = threading.Condition()
        self.current = 0
        self.peak = 0

    def enter(self) -> None:
        with self._cond:
            self.current += 1
            self.peak = max(self.peak, self.current)
            self._cond.notify_all()

    def exit(self) -> None:
        with self._cond:
            self.current -= 1
            self._cond.notify_all()

    def wait_until(self, n: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.current >= n, WAIT_S):
                raise AssertionError(f"only {self.current} calls in flight, wanted {n}")


class PassRecorder:
    """An ``on_pass_complete`` sink that keeps every result and lets tests wait for them."""

    def __init__(self) -> None:
        # _cond guards results.
        self._cond = threading.Condition()
        self.results: list[PassResult] = []

    def __call__(self, result: PassResult) -> None:
        with self._cond:
            self.results.append(result)
            self._cond.notify_all()

    def of_kind(self, kind: PassKind) -> list[PassResult]:
        with self._cond:
            return [r for r in self.results if r.kind is kind]

    def wait_for(self, kind: PassKind, count: int = 1) -> list[PassResult]:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: sum(1 for r in self.results if r.kind is kind) >= count, WAIT_S
            )
            found = [r for r in self.results if r.kind is kind]
        if not ok:
            raise AssertionError(f"got {len(found)} {kind.value} results, wanted {count}")
        return found


class FakeRenewalTarget:
    """A renewal target over a list of ids; hooks run inside the calls."""

    def __init__(
        self,
        ids: Iterable[str] = (),
        *,
        failures: Mapping[str, Exception] | None = None,
        on_list: Callable[[], None] | None = None,
        on_renew: Callable[[str], object] | None = None,
    ) -> None:
        # _lock guards held, list_calls and renewed.
        self._lock = threading.Lock()
        self.held = list(ids)
        self.failures = dict(failures or {})
        self.on_list = on_list
        self.on_renew = on_renew
        self.list_calls = 0
        self.renewed: list[str] = []

    def list_held_workflow_ids(self) -> list[str]:
        with self._lock:
            self.list_calls += 1
            held = list(self.held)
        if self.on_list is not None:
            self.on_list()
        return held

    def renew_workflow_claim(self, workflow_id: str) -> None:
        if self.on_renew is not None:
            self.on_renew(workflow_id)
        with self._lock:
            self.renewed.append(workflow_id)
        error = self.failures.get(workflow_id)
        if error is not None:
            raise error


class FakeBatchRenewalTarget(FakeRenewalTarget):
    """A renewal target that also renews in batches, recording each batch it was given."""

    def __init__(
        self,
        ids: Iterable[str] = (),
        *,
        failures: Mapping[str, Exception] | None = None,
        on_batch: Callable[[Sequence[str]], None] | None = None,
        batch_result: Callable[[Sequence[str]], list[object]] | None = None,
    ) -> None:
        super().__init__(ids, failures=failures)
        self.batches: list[list[str]] = []
        self.on_batch = on_batch
        self.batch_result = batch_result

    def renew_workflow_claim(self, workflow_id: str) -> None:
        raise AssertionError("a batched target must be renewed through renew_workflow_claims")

    def renew_workflow_claims(self, workflow_ids: Sequence[str]) -> list[object]:
        with self._lock:
            self.batches.append(list(workflow_ids))
        if self.on_batch is not None:
            self.on_batch(workflow_ids)
        if self.batch_result is not None:
            return self.batch_result(workflow_ids)
        return [self.failures.get(wid) for wid in workflow_ids]


class FakeReclaimTarget:
    """A reclaim target with scripted candidates and per-id results (str or exception)."""

    def __init__(
        self,
        candidates: Iterable[str] = (),
        *,
        results: Mapping[str, object] | None = None,
        on_list: Callable[[], None] | None = None,
        on_attempt: Callable[[str], None] | None = None,
        list_error: Exception | None = None,
    ) -> None:
        # _lock guards list_calls and attempts.
        self._lock = threading.Lock()
        self.candidates = list(candidates)
        self.results = dict(results or {})
        self.on_list = on_list
        self.on_attempt = on_attempt
        self.list_error = list_error
        self.list_calls = 0
        self.attempts: list[str] = []

    def list_reclaim_candidate_workflow_ids(self) -> list[str]:
        with self._lock:
            self.list_calls += 1
        if self.on_list is not None:
            self.on_list()
        if self.list_error is not None:
            raise self.list_error
        return list(self.candidates)

    def attempt_workflow_claim_takeover(self, workflow_id: str) -> str:
        with self._lock:
            self.attempts.append(workflow_id)
        if self.on_attempt is not None:
            self.on_attempt(workflow_id)
        result = self.results.get(workflow_id, "not-eligible")
        if isinstance(result, Exception):
            raise result
        assert isinstance(result, str)
        return result


class FakeSignalPollTarget:
    """A signal-poll target over parked waits and a set of buffered ``(id, signal)`` pairs."""

    def __init__(
        self,
        waits: Iterable[tuple[str, str]] = (),
        *,
        buffered: Iterable[tuple[str, str]] = (),
        wake_errors: Mapping[str, Exception] | None = None,
        probe_error: Exception | None = None,
        on_list: Callable[[], None] | None = None,
    ) -> None:
        # _lock guards probes and woken.
        self._lock = threading.Lock()
        self.waits = [ParkedSignalWait(w, s) for w, s in waits]
        self.buffered = set(buffered)
        self.wake_errors = dict(wake_errors or {})
        self.probe_error = probe_error
        self.on_list = on_list
        self.probes: list[tuple[str, str]] = []
        self.woken: list[str] = []

    def list_parked_signal_waits(self) -> list[ParkedSignalWait]:
        if self.on_list is not None:
            self.on_list()
        return list(self.waits)

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool:
        with self._lock:
            self.probes.append((workflow_id, signal_name))
        if self.probe_error is not None:
            raise self.probe_error
        return (workflow_id, signal_name) in self.buffered

    def wake_workflow(self, workflow_id: str) -> None:
        with self._lock:
            self.woken.append(workflow_id)
        error = self.wake_errors.get(workflow_id)
        if error is not None:
            raise error


class FakeUpdatePollTarget:
    """An update-poll target over held ids and a set of ids with pending updates."""

    def __init__(
        self,
        held: Iterable[str] = (),
        *,
        pending: Iterable[str] = (),
        drain_errors: Mapping[str, Exception] | None = None,
        on_list: Callable[[], None] | None = None,
    ) -> None:
        # _lock guards drained.
        self._lock = threading.Lock()
        self.held = list(held)
        self.pending = set(pending)
        self.drain_errors = dict(drain_errors or {})
        self.on_list = on_list
        self.drained: list[str] = []

    def list_held_workflow_ids(self) -> list[str]:
        if self.on_list is not None:
            self.on_list()
        return list(self.held)

    def has_pending_updates(self, workflow_id: str) -> bool:
        return workflow_id in self.pending

    def drain_pending_updates(self, workflow_id: str) -> None:
        with self._lock:
            self.drained.append(workflow_id)
        error = self.drain_errors.get(workflow_id)
        if error is not None:
            raise error


def write_workflow(
    storage: Storage, workflow_id: str, status: str = "running", wf_type: str = "import"
) -> None:
    """Store a workflow record and its status-index entry."""
    record = WorkflowRecord(workflow_id, wf_type, status)
    storage.put(keys.workflow(workflow_id), encode_workflow_record(record))
    storage.put(keys.workflow_status_index(status, workflow_id), b"")


def complete_workflow(storage: Storage, workflow_id: str) -> None:
    """Move a running workflow's record and index entry to ``completed``."""
    storage.delete(keys.workflow_status_index("running", workflow_id))
    write_workflow(storage, workflow_id, "completed")


def claim_attempts(metrics: ClaimMetrics) -> dict[str, int]:
    """The non-zero claim-attempt counters of ``metrics``."""
    return {k: v for k, v in metrics.snapshot().attempts.items() if v}
