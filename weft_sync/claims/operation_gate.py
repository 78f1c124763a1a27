"""The registry's operation gate: what lets ``close()`` leave no claim behind in the store.

Every operation that can create a claim (acquire, folded acquire, takeover, resume) runs inside
:meth:`OperationGate.operation`. :meth:`OperationGate.close` refuses new operations from then on
(they raise :class:`~weft_sync.errors.ClosedError` before any I/O) and waits, bounded, for those
in flight, so the registry's final release sees every claim they made. A claim installed after
that final release began (an operation that outlived the wait) is refused at install and given
back by the operation itself (see ``ClaimRegistry``).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from ..errors import ClosedError


class OperationGate:
    """Counts claim-creating operations in flight and refuses new ones once closing.

    :param engine_id: this engine's id, for error messages.
    """

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        # _lock guards _closing and _active; _drained (on _lock) is notified when _active is 0.
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._closing = False
        self._active = 0

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called."""
        with self._lock:
            return self._closing

    def operation(self, what: str) -> _Operation:
        """``with gate.operation(what):`` runs the body as one operation in flight.

        :raises ClosedError: (on entering) :meth:`close` was called; nothing is run.
        """
        return _Operation(self, what)

    def _enter(self, what: str) -> None:
        with self._lock:
            if self._closing:
                raise ClosedError(
                    f"{what} was called while the claim registry of engine {self._engine_id} "
                    f"closes or after it closed; open a new Ownership to claim workflows again"
                )
            self._active += 1

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._drained.notify_all()

    def close(self, timeout: float | None) -> bool:
        """Refuse new operations; wait up to ``timeout`` seconds for those in flight.

        :returns: whether none was left in flight.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._lock:
            self._closing = True
            while self._active:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._drained.wait(remaining)
            return True

    def reset(self) -> None:
        """Start afresh (a forked child: a parent thread may have held the lock)."""
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._closing = False
        self._active = 0


class _Operation:
    """One operation's ``with`` block (a class, not a generator: every claim enters one)."""

    __slots__ = ("_gate", "_what")

    def __init__(self, gate: OperationGate, what: str) -> None:
        self._gate = gate
        self._what = what

    def __enter__(self) -> None:
        self._gate._enter(self._what)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._gate._exit()
