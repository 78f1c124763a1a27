"""The protocol every connection family implements for the host-data fence, and its helpers.

A :class:`HostTransaction` wraps one host connection for one fenced block: it begins a
transaction (or a savepoint inside one already open), runs the fence's own statements, and ends
what it began. :mod:`weft_sync.fencing.core` drives it; one module per connection family
implements it, and imports its driver only when the host has already imported it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["HostTransaction", "as_value", "savepoint_name"]

_savepoints = itertools.count(1)


def savepoint_name() -> str:
    """A fresh savepoint name (unique in the process, so nested fences never collide)."""
    return f"weft_fence_{next(_savepoints)}"


def as_value(raw: object) -> bytes | None:
    """A stored value as bytes: drivers hand back ``bytes``, ``memoryview`` or ``bytearray``."""
    if raw is None or type(raw) is bytes:
        return raw
    if isinstance(raw, (bytearray, memoryview)):
        return bytes(raw)
    if isinstance(raw, str):
        return raw.encode("utf-8")
    raise TypeError(f"the epoch row holds a {type(raw).__name__}, not bytes: {raw!r:.80}")


@runtime_checkable
class HostTransaction(Protocol):
    """One host connection, adapted for one fenced block.

    ``begin`` → the fence's statements through ``query`` → the host's statements → ``end``. The
    adapter never commits anything it did not begin: inside a transaction already open it works
    in a savepoint, and ``end`` releases or rolls back only that savepoint.
    """

    @property
    def family(self) -> str:
        """The connection's SQL family (``"sqlite"``, ``"postgresql"``, or what it really is)."""
        ...

    @property
    def connection_key(self) -> object | None:
        """A weak-referenceable object that lives as long as the physical connection, or
        ``None`` when there is none (the last proof is then a guess that every block re-checks,
        see :class:`~weft_sync.storage.fence_target.FenceBinding`)."""
        ...

    @property
    def result(self) -> object:
        """What the fenced block yields: the connection, session or wrapper the host gave."""
        ...

    def begin(self) -> bool:
        """Begin the transaction or savepoint.

        :returns: whether the database's write lock is already held (SQLite's ``BEGIN
            IMMEDIATE``; always true for PostgreSQL, whose fence locks a row instead).
        """
        ...

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        """Run one statement (the family's parameter style) and return its rows."""
        ...

    def end(self, error: BaseException | None) -> None:
        """Commit what :meth:`begin` began, or roll it back when ``error`` is not ``None``."""
        ...
