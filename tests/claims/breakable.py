"""A real store that can be made to fail every call, for as long as a test wants.

``BreakableStorage`` delegates to a real backend through :class:`~tests.reliability.faulty.
FaultyStorage` (with no random faults) and, while ``error`` is set, raises it from every
storage call before reaching the store: an unreachable store (``StorageError``) or a store
replaced under the engine (``StoreIdentityError``). ``capabilities`` and ``close`` never fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tests.reliability.faulty import FaultyStorage
from weft_sync.storage.base import Storage

_T = TypeVar("_T")


class BreakableStorage(FaultyStorage):
    """A real store whose calls raise ``error`` while it is set (see the module docstring)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner, rate=0.0)
        self.error: BaseException | None = None
        self.refused = 0

    def _call(self, method: str, fn: Callable[[], _T]) -> _T:
        error = self.error
        if error is not None:
            with self._lock:
                self.calls[method] += 1
                self.refused += 1
            raise error
        return super()._call(method, fn)
