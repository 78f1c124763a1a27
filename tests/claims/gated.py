"""Test helpers: wrappers around a real store, a log watcher, a thread runner, registries.

``GatedStorage`` delegates every call to a real backend and counts it. Tests can arm one-shot
intercepts on the next compare-and-swap (``conditional_batch``, ``conditional_batches`` or
``compare_and_set_many``, whose rows are matched as the equivalent batches) that match a
predicate: force its result without writing, raise before or after committing, run a callback
just before it commits, or pause the calling thread at a gate until the test opens it.
``BatchesOnly`` hides ``compare_and_set_many`` (and can misreport results or the capability), so
callers take the ``conditional_batches`` fallback. :func:`new_registry` builds a
``ClaimRegistry`` with the test timing (:data:`TTL_MS`, :data:`RENEW_MS`) on any store.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.claims.renewals import WarnSink
from weft_sync.clock import Clock
from weft_sync.codec import HolderRecord, encode_holder
from weft_sync.storage.base import Batch, Condition, Operation, Storage, StorageCapabilities
from weft_sync.storage.cas import CasRow, cas_batches, storage_compare_and_set_many

GATE_TIMEOUT_S = 30.0
CAS_METHODS = ("conditional_batch", "conditional_batches", "compare_and_set_many")
_T = TypeVar("_T")

BatchMatcher = Callable[[Sequence[Batch]], bool]


def touches(workflow_id: str) -> BatchMatcher:
    """Match a CAS that names either claim key of ``workflow_id``."""
    claim_keys = {keys.workflow_owner_holder(workflow_id), keys.workflow_owner_epoch(workflow_id)}

    def match(batches: Sequence[Batch]) -> bool:
        for conditions, operations in batches:
            if any(c.key in claim_keys for c in conditions):
                return True
            if any(op.key in claim_keys for op in operations):
                return True
        return False

    return match


@dataclass
class Intercept:
    """One armed intercept; ``reached`` is set when a CAS hits it, ``open()`` lets it continue."""

    match: BatchMatcher | None = None
    pause: bool = False
    before: Callable[[], object] | None = None
    force: bool | None = None
    error: BaseException | None = None
    after_commit: bool = False
    reached: threading.Event = field(default_factory=threading.Event)
    _opened: threading.Event = field(default_factory=threading.Event)

    def open(self) -> None:
        """Let the paused caller continue."""
        self._opened.set()

    def wait_reached(self, timeout: float = GATE_TIMEOUT_S) -> None:
        """Block until a CAS hit this intercept, failing the test after ``timeout`` seconds."""
        if not self.reached.wait(timeout):
            raise AssertionError("no compare-and-swap reached the gate")


class GatedStorage:
    """A real store plus call counting and one-shot intercepts on the next matching CAS.

    :param inner: the real store every call is delegated to.
    :param conditional_batch: override the declared ``conditional_batch`` capability.
    """

    def __init__(self, inner: Storage, *, conditional_batch: bool | None = None) -> None:
        self.inner = inner
        self._capability_override = conditional_batch
        # _lock guards calls and _intercepts.
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self._intercepts: list[Intercept] = []

    # -- arming ----------------------------------------------------------------------------

    def intercept_next_cas(self, **kwargs: Any) -> Intercept:
        """Arm an intercept (see :class:`Intercept` fields) for the next matching CAS."""
        intercept = Intercept(**kwargs)
        with self._lock:
            self._intercepts.append(intercept)
        return intercept

    def force_next_cas(self, result: bool, *, match: BatchMatcher | None = None) -> Intercept:
        """Make the next matching CAS return ``result`` without touching the store."""
        return self.intercept_next_cas(force=result, match=match)

    def raise_on_next_cas(
        self, error: BaseException, *, after_commit: bool = False, match: BatchMatcher | None = None
    ) -> Intercept:
        """Make the next matching CAS raise ``error``, before or after it commits."""
        return self.intercept_next_cas(error=error, after_commit=after_commit, match=match)

    def pause_next_cas(self, *, match: BatchMatcher | None = None, **kwargs: Any) -> Intercept:
        """Pause the next matching CAS until ``open()``; extra fields apply after the gate."""
        return self.intercept_next_cas(pause=True, match=match, **kwargs)

    def before_next_cas(
        self, callback: Callable[[], object], *, match: BatchMatcher | None = None
    ) -> Intercept:
        """Run ``callback`` (e.g. a competitor's write) just before the next matching CAS."""
        return self.intercept_next_cas(before=callback, match=match)

    def clear_intercepts(self) -> None:
        """Disarm every intercept no CAS has hit yet."""
        with self._lock:
            self._intercepts.clear()

    # -- counters --------------------------------------------------------------------------

    @property
    def transactions(self) -> int:
        """How many compare-and-swap transactions were started."""
        with self._lock:
            return sum(self.calls[name] for name in CAS_METHODS)

    @property
    def total_calls(self) -> int:
        """How many calls of any kind (including capability reads) reached this wrapper."""
        with self._lock:
            return sum(self.calls.values())

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def _take(self, batches: Sequence[Batch]) -> Intercept | None:
        with self._lock:
            for index, intercept in enumerate(self._intercepts):
                if intercept.match is None or intercept.match(batches):
                    del self._intercepts[index]
                    return intercept
        return None

    # -- the Storage protocol --------------------------------------------------------------

    @property
    def capabilities(self) -> StorageCapabilities:
        self._count("capabilities")
        caps = self.inner.capabilities
        if self._capability_override is None:
            return caps
        return StorageCapabilities(
            conditional_batch=self._capability_override,
            multi_process=caps.multi_process,
            multi_host=caps.multi_host,
        )

    def get(self, key: str) -> bytes | None:
        self._count("get")
        return self.inner.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._count("put")
        self.inner.put(key, value)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def scan(self, prefix: str = "", **kwargs: Any) -> list[tuple[str, bytes]]:
        self._count("scan")
        return self.inner.scan(prefix, **kwargs)

    def batch(self, operations: Sequence[Operation]) -> None:
        self._count("batch")
        self.inner.batch(operations)

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        self._count("conditional_batch")
        batch: Batch = (conditions, operations)
        results = self._run([batch], lambda: [self.inner.conditional_batch(conditions, operations)])
        return results[0]

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        self._count("conditional_batches")
        return self._run(batches, lambda: self.inner.conditional_batches(batches))

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        self._count("compare_and_set_many")
        return self._run(cas_batches(rows), lambda: storage_compare_and_set_many(self.inner, rows))

    def _run(self, batches: Sequence[Batch], commit: Callable[[], list[bool]]) -> list[bool]:
        intercept = self._take(batches)
        if intercept is None:
            return commit()
        intercept.reached.set()
        if intercept.pause and not intercept._opened.wait(GATE_TIMEOUT_S):
            raise AssertionError("the test never opened the gate")
        if intercept.before is not None:
            intercept.before()
        if intercept.error is not None and not intercept.after_commit:
            raise intercept.error
        if intercept.force is not None:
            return [intercept.force] * len(batches)
        results = commit()
        if intercept.error is not None:
            raise intercept.error
        return results

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> GatedStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BatchesOnly:
    """A real store seen through the Storage protocol alone (no ``compare_and_set_many``)."""

    def __init__(self, inner: Storage, *, capable: bool = True, drop_result: bool = False) -> None:
        self.inner = inner
        self.capable = capable
        self.drop_result = drop_result
        self.batches_calls = 0

    @property
    def capabilities(self) -> StorageCapabilities:
        caps = self.inner.capabilities
        return StorageCapabilities(self.capable, caps.multi_process, caps.multi_host)

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        self.batches_calls += 1
        results = self.inner.conditional_batches(batches)
        return results[:-1] if self.drop_result else results

    def __getattr__(self, name: str) -> Any:
        if name == "compare_and_set_many":
            raise AttributeError(name)
        return getattr(self.inner, name)


class LogWatcher(logging.Handler):
    """Collects records of one logger and lets a test wait for a message to appear."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        # _cond guards records.
        self._cond = threading.Condition()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def messages(self, level: int | None = None) -> list[str]:
        with self._cond:
            return [r.getMessage() for r in self.records if level is None or r.levelno == level]

    def wait_for(self, fragment: str, *, count: int = 1, timeout: float = GATE_TIMEOUT_S) -> None:
        """Block until ``count`` messages containing ``fragment`` were logged."""

        def seen() -> bool:
            return sum(fragment in r.getMessage() for r in self.records) >= count

        with self._cond:
            if not self._cond.wait_for(seen, timeout):
                raise AssertionError(f"never logged {count} x {fragment!r}")


@contextmanager
def watch_log(name: str) -> Iterator[LogWatcher]:
    """Attach a :class:`LogWatcher` to logger ``name`` at DEBUG for the block."""
    logger = logging.getLogger(name)
    watcher = LogWatcher()
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watcher)
    try:
        yield watcher
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(old_level)


class Worker(Generic[_T]):
    """Runs ``fn`` on a named daemon thread; ``result()`` joins and re-raises its exception."""

    def __init__(self, fn: Callable[[], _T], name: str) -> None:
        self._fn = fn
        self._value: _T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # re-raised in the test thread by result()
            self._error = exc

    def join(self, timeout: float = GATE_TIMEOUT_S) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"thread {self._thread.name} did not finish")

    def result(self, timeout: float = GATE_TIMEOUT_S) -> _T:
        self.join(timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def error(self, timeout: float = GATE_TIMEOUT_S) -> BaseException | None:
        self.join(timeout)
        return self._error


def pause_in_cas(
    store: GatedStorage, workflow_id: str, fn: Callable[[], _T], name: str, **fields: Any
) -> tuple[Intercept, Worker[_T]]:
    """Run ``fn`` on thread ``name`` until its CAS naming ``workflow_id`` waits at a gate.

    :param fields: further :class:`Intercept` fields, applied once the gate opens (``error``).
    :returns: the gate (``open()`` lets the CAS go on) and the worker running ``fn``.
    """
    gate = store.pause_next_cas(match=touches(workflow_id), **fields)
    worker = Worker(fn, name)
    gate.wait_reached()
    return gate, worker


REGISTRY_LOGGER = "weft_sync.claims.registry"
JOINS_RENEWAL = "joins the renewal already in flight"
"""Logged by a renewal that shares the renewal of the same claim already in flight."""
WAITS_FOR_RENEWAL = "waits for the renewal in flight"
"""Logged by a release (or a release preparation) that waits for the renewal in flight."""


def start_until_logged(
    fn: Callable[[], _T], name: str, fragment: str, logger: str = REGISTRY_LOGGER
) -> Worker[_T]:
    """Run ``fn`` on thread ``name`` and return once logger ``logger`` logged ``fragment``.

    Used to start a call that must wait for one paused at a gate: the message says it waits.
    """
    with watch_log(logger) as log:
        worker = Worker(fn, name)
        log.wait_for(fragment)
    return worker


TTL_MS = 30_000
RENEW_MS = 5_000
START_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
"""Advancing the clock by this much makes an unrenewed claim takeover-eligible."""


def new_registry(
    store: Storage, clock: Clock, engine_id: str = "engine-a", warn: WarnSink | None = None
) -> ClaimRegistry:
    """A registry of ``engine_id`` on ``store`` with the test timing and ``warn`` as its sink."""
    return ClaimRegistry(
        store,
        engine_id=engine_id,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=warn,
    )


class WarningSink:
    """A thread-safe ``warn`` sink that records what it receives."""

    def __init__(self) -> None:
        # _lock guards received.
        self._lock = threading.Lock()
        self.received: list[Warning] = []

    def __call__(self, warning: Warning) -> None:
        with self._lock:
            self.received.append(warning)

    def lost_ids(self) -> list[str]:
        with self._lock:
            return [getattr(w, "workflow_id", "?") for w in self.received]


def hold_folded(reg: ClaimRegistry, storage: Storage, ids: Sequence[str]) -> None:
    """Acquire many claims in one transaction through folded acquires."""
    preparations = [reg.prepare_acquire_fragment(wid) for wid in ids]
    committed = storage.conditional_batches(
        [(p.fragment.conditions, p.fragment.operations) for p in preparations]
    )
    assert all(committed)
    for wid, prep in zip(ids, preparations, strict=True):
        reg.record_folded_acquire(wid, prep)


def steal_holder(storage: Storage, wid: str) -> bytes:
    """Replace the holder of ``wid`` with engine B's; return the bytes written."""
    value = encode_holder(HolderRecord("engine-b", 9, 0, 0))
    storage.put(keys.workflow_owner_holder(wid), value)
    return value
