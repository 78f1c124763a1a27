"""A storage wrapper that injects transient faults into a real store.

``FaultyStorage`` delegates every call to a real backend. On a random fraction of the calls
(a seeded RNG, so a failing run can be replayed) it injects one fault:

- ``before``: raise :class:`~weft_sync.errors.StorageError` without reaching the store (nothing
  was read or written);
- ``after``: let the call reach the store, then raise ``StorageError`` anyway (a write *landed*
  but the caller sees an error, like a connection lost during COMMIT);
- ``delay``: sleep a few milliseconds, then make the call normally.

Each method draws from its own seeded RNG stream, so the n-th call of a method meets the same
fault in every run even when threads interleave differently. Faults never touch
``capabilities`` or ``close``. Every call and every fault is counted.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, Literal, TypeVar

from weft_sync.errors import StorageError
from weft_sync.storage.base import Batch, Condition, Operation, Storage, StorageCapabilities
from weft_sync.storage.cas import CasRow, storage_compare_and_set_many
from weft_sync.storage.reads import storage_get_many

__all__ = ["FAULT_KINDS", "FaultKind", "FaultyStorage", "InjectedFault"]

FaultKind = Literal["before", "after", "delay"]
FAULT_KINDS: Final[tuple[FaultKind, ...]] = ("before", "after", "delay")
WRITE_METHODS: Final = frozenset(
    {"put", "delete", "batch", "conditional_batch", "conditional_batches", "compare_and_set_many"}
)

_T = TypeVar("_T")


class InjectedFault(StorageError):
    """A fault injected by :class:`FaultyStorage`; ``committed`` says whether the call ran."""

    def __init__(self, method: str, kind: FaultKind) -> None:
        self.method = method
        self.kind = kind
        self.committed = kind == "after"
        where = "after it reached the store" if self.committed else "before it reached the store"
        super().__init__(f"injected fault: {method}() failed {where}")


class FaultyStorage:
    """A real store plus seeded random transient faults (see the module docstring).

    :param inner: the real store every call is delegated to.
    :param rate: probability in ``[0, 1]`` that one call gets a fault.
    :param seed: seed of the per-method RNG streams choosing which calls fail and how.
    :param kinds: the fault kinds to choose from, uniformly.
    :param delay_ms: ``(low, high)`` bounds of an injected delay, in milliseconds.
    :param methods: the methods that may fail (default: every storage call).
    """

    def __init__(
        self,
        inner: Storage,
        *,
        rate: float = 0.02,
        seed: int = 0,
        kinds: Sequence[FaultKind] = FAULT_KINDS,
        delay_ms: tuple[float, float] = (1.0, 3.0),
        methods: Sequence[str] | None = None,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate!r}")
        unknown = set(kinds) - set(FAULT_KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be a non-empty subset of {FAULT_KINDS}, got {kinds!r}")
        self.inner = inner
        self._kinds = tuple(kinds)
        self._delay_ms = delay_ms
        self._methods = None if methods is None else frozenset(methods)
        # _lock guards _rngs, _rate, calls and faults.
        self._lock = threading.Lock()
        self._seed = seed
        self._rngs: dict[str, random.Random] = {}
        self._rate = rate
        self.calls: Counter[str] = Counter()
        self.faults: Counter[tuple[str, FaultKind]] = Counter()

    # -- control ---------------------------------------------------------------------------

    @property
    def rate(self) -> float:
        with self._lock:
            return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {value!r}")
        with self._lock:
            self._rate = value

    @contextmanager
    def faults_off(self) -> Iterator[None]:
        """Let every call through unharmed for the block."""
        saved = self.rate
        self.rate = 0.0
        try:
            yield
        finally:
            self.rate = saved

    def fault_count(self, kind: FaultKind | None = None, *, writes_only: bool = False) -> int:
        """How many faults were injected (of ``kind``, optionally only into writes)."""
        with self._lock:
            return sum(
                n
                for (method, k), n in self.faults.items()
                if (kind is None or k == kind) and (not writes_only or method in WRITE_METHODS)
            )

    @property
    def total_calls(self) -> int:
        with self._lock:
            return sum(self.calls.values())

    # -- fault injection -------------------------------------------------------------------

    def _draw(self, method: str) -> tuple[FaultKind | None, float]:
        with self._lock:
            self.calls[method] += 1
            if self._methods is not None and method not in self._methods:
                return None, 0.0
            rng = self._rngs.get(method)
            if rng is None:
                rng = self._rngs[method] = random.Random(f"{self._seed}:{method}")
            if self._rate <= 0.0 or rng.random() >= self._rate:
                return None, 0.0
            kind = rng.choice(self._kinds)
            delay_s = rng.uniform(*self._delay_ms) / 1000.0
            self.faults[(method, kind)] += 1
        return kind, delay_s

    def _call(self, method: str, fn: Callable[[], _T]) -> _T:
        kind, delay_s = self._draw(method)
        if kind == "before":
            raise InjectedFault(method, kind)
        if kind == "delay":
            time.sleep(delay_s)
        result = fn()
        if kind == "after":
            raise InjectedFault(method, kind)
        return result

    # -- the Storage protocol --------------------------------------------------------------

    @property
    def capabilities(self) -> StorageCapabilities:
        return self.inner.capabilities

    def get(self, key: str) -> bytes | None:
        return self._call("get", lambda: self.inner.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", lambda: storage_get_many(self.inner, keys))

    def put(self, key: str, value: bytes) -> None:
        self._call("put", lambda: self.inner.put(key, value))

    def delete(self, key: str) -> None:
        self._call("delete", lambda: self.inner.delete(key))

    def scan(self, prefix: str = "", **kwargs: Any) -> list[tuple[str, bytes]]:
        return self._call("scan", lambda: self.inner.scan(prefix, **kwargs))

    def batch(self, operations: Sequence[Operation]) -> None:
        self._call("batch", lambda: self.inner.batch(operations))

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        return self._call(
            "conditional_batch", lambda: self.inner.conditional_batch(conditions, operations)
        )

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        return self._call("conditional_batches", lambda: self.inner.conditional_batches(batches))

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        return self._call(
            "compare_and_set_many", lambda: storage_compare_and_set_many(self.inner, rows)
        )

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> FaultyStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r}, rate={self.rate})"
