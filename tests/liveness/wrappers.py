"""Thin wrappers around a real store for the liveness tests: hide, count or fail session locks."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from weft_sync.errors import StorageError
from weft_sync.storage import Storage, StorageCapabilities
from weft_sync.storage.session_locks import LockState, SessionLock, storage_session_locks


class WithoutSessionLocks:
    """Forwards every call to a real store but declares no session-lock capability."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    @property
    def capabilities(self) -> StorageCapabilities:
        return replace(self._inner.capabilities, session_locks=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ProbeCounting:
    """Forwards to a real store; counts lock probes, and can fail probes or puts on demand.

    A failing probe raises ``probe_error`` (a ``StorageError`` unless a test sets another).
    """

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        locks = storage_session_locks(inner)
        assert locks is not None
        self._locks = locks
        self._cond = threading.Condition()  # guards the counters and the failure switches
        self.probes = 0
        self.fail_probes = 0
        self.probe_error: BaseException = StorageError("injected probe failure")
        self.fail_puts = False
        self.puts = 0
        # When set: a put waits for ``release_puts`` after announcing itself on ``put_waiting``.
        self.hold_puts = False
        self.put_waiting = threading.Event()
        self.release_puts = threading.Event()

    @property
    def capabilities(self) -> StorageCapabilities:
        return self._inner.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, key: str, value: bytes) -> None:
        with self._cond:
            self.puts += 1
        if self.fail_puts:
            raise StorageError(f"injected put failure on {key!r}")
        if self.hold_puts:
            self.put_waiting.set()
            assert self.release_puts.wait(30), "the test never released the held put"
        self._inner.put(key, value)

    def acquire_session_lock(self, name: str) -> SessionLock:
        return self._locks.acquire_session_lock(name)

    def forget_session_lock(self, name: str) -> None:
        self._locks.forget_session_lock(name)

    def _count_probe(self) -> None:
        with self._cond:
            self.probes += 1
            self._cond.notify_all()
            failing = self.fail_probes > 0
            if failing:
                self.fail_probes -= 1
        if failing:
            raise self.probe_error

    def held_session_locks(self, names: Collection[str]) -> set[str]:
        self._count_probe()
        return self._locks.held_session_locks(names)

    def probe_session_locks(self, locks: Mapping[str, str | None]) -> dict[str, LockState]:
        self._count_probe()
        return self._locks.probe_session_locks(locks)

    def wait_for_probes(self, count: int, timeout: float = 30.0) -> None:
        """Block until ``count`` more probes than now have run."""
        with self._cond:
            target = self.probes + count
            if not self._cond.wait_for(lambda: self.probes >= target, timeout):
                raise AssertionError(f"only {self.probes} of {target} probes ran")
