"""The protocol every connection family implements for the host-data fence, and its helpers.

A :class:`HostTransaction` wraps one host connection for one fenced block: it begins a
transaction (or a savepoint inside one already open), runs the fence's own statements, and ends
what it began. :mod:`weft_sync.fencing.core` drives it; one module per connection family
implements it, and imports its driver only when the host has already imported it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol, runtime_checkable

from ..errors import StorageError, StoreIdentityError
from ..storage.fence_proof import FenceBinding

_savepoints = itertools.count(1)


def savepoint_name() -> str:
    """A fresh savepoint name (unique in the process, so nested fences never collide)."""
    return f"weft_fence_{next(_savepoints)}"


ENDED_INSIDE = (
    "the fenced transaction was ended inside the block (commit(), rollback() or a COMMIT "
    "statement on the connection); the block rolled back what was open and committed nothing"
)
"""What a block whose transaction the host ended inside it says (PostgreSQL, SQLAlchemy)."""


def ended_inside(workflow_id: str | None = None) -> StorageError:
    """The error of a block (for ``workflow_id``, when known) whose transaction was ended
    inside it."""
    if workflow_id is None:
        return StorageError(ENDED_INSIDE)
    return StorageError(f"{ENDED_INSIDE} (workflow {workflow_id!r})")


def as_value(raw: object) -> bytes | None:
    """A stored value as bytes: drivers hand back ``bytes``, ``memoryview`` or ``bytearray``."""
    if raw is None or type(raw) is bytes:
        return raw
    if isinstance(raw, (bytearray, memoryview)):
        return bytes(raw)
    if isinstance(raw, str):
        return raw.encode("utf-8")
    raise TypeError(f"the epoch row holds a {type(raw).__name__}, not bytes: {raw!r:.80}")


def first_value(row: Sequence[object] | None) -> bytes | None:
    """The epoch value in the first column of ``row`` (a fetched row or ``None``), as bytes."""
    return None if row is None else as_value(row[0])


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
        see :class:`~weft_sync.storage.fence_proof.FenceBinding`)."""
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
        """Commit what :meth:`begin` began, or roll it back when ``error`` is not ``None``.

        The fence runs its end check (``FenceBinding.end_check``) through :meth:`query` just
        before ``end(None)``. ``end(error)`` rolls back whatever transaction is open when the
        host ended the one :meth:`begin` began inside the block and began another.
        """
        ...


class SupportsCommitChecked(Protocol):
    """A :class:`HostTransaction` that can send the fence's end check with its ``COMMIT`` (one
    round trip): psycopg2 in autocommit mode, which sent the block's ``BEGIN`` itself."""

    def commit_checked(self, binding: FenceBinding, workflow_id: str) -> bool:
        """Commit with ``binding.commit_checked`` when this block can; ``False`` (nothing sent)
        when it cannot, and the fence then checks and ends the block itself.

        :raises StorageError: the check failed (:func:`ended_inside`); rolled back.
        """
        ...


FindBinding = Callable[[object], "FenceBinding | None"]
"""``find(connection_key)``: the binding proven for the connection a
:attr:`HostTransaction.connection_key` stands for, ``None`` when it was not proven yet."""


class SupportsBeginReading(Protocol):
    """A :class:`HostTransaction` that can begin and run the fence's epoch read in one call on
    a connection proven before, without the fence's generic steps in between (sqlite3:
    ``BEGIN IMMEDIATE``, the binding's re-check and the read; psycopg2 in autocommit mode:
    ``BEGIN`` and the read as one query, one round trip).

    Where the driver begins the transaction itself, ``BEGIN`` goes alone, on a round trip of
    its own, before the read: psycopg 3 (a proven connection takes
    :class:`~weft_sync.fencing.psycopg.PsycopgBlock`, not this protocol) and psycopg2 outside
    autocommit mode (its implicit ``BEGIN``). A proven psycopg2 block outside autocommit mode
    is ``BEGIN``, the read, the host's statements, the end check (``FenceBinding.end_check``)
    and ``COMMIT``: two round trips more than the block unfenced; in autocommit mode ``BEGIN``
    goes with the read and the check with ``COMMIT``, none more. A proven psycopg 3 block
    outside autocommit mode sends the check with its ``COMMIT`` (one more round trip, the
    read's); in autocommit mode it keeps psycopg's ``connection.transaction()`` and sends the
    check alone (two more)."""

    def begin_reading(
        self, find: FindBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """Begin the transaction and run the epoch read of ``find(connection_key)`` with
        ``params``, returning its rows; ``None`` when it cannot (the connection was not proven
        yet, a transaction is already open, the binding's re-check fails, the binding has no
        form it can use), having sent nothing: the fence then calls ``begin`` and ``query``
        and proves the connection. An adapter whose connection is known only once its
        transaction began (a SQLAlchemy ``Session``) calls ``find`` after that.

        :raises Exception: the driver's error when a statement failed; the transaction is then
            open (or aborted) and the fence ends it through ``end``.
        """
        ...


class FenceContext(Protocol):
    """What a connection family's own fast block gets from the engine's fence
    (:class:`~weft_sync.fencing.core.HostFence`): the shared state and the fence's rules, so
    that the block decides nothing the generic block would decide otherwise."""

    @property
    def hint(self) -> FenceBinding | None:
        """The binding last proven on a connection that keeps no proof of its own."""
        ...

    @property
    def epoch_of(self) -> Callable[[str], bytes | None]:
        """This engine's epoch bytes for a workflow, ``None`` when it holds no claim on it.

        :raises TypeError: the id is not a ``str``.
        :raises ValueError: the id cannot name a workflow.
        """
        ...

    def read_params(self, workflow_id: str) -> tuple[str, ...]:
        """The epoch read's parameters for ``workflow_id``."""
        ...

    def proof_for(self, connection_key: object | None) -> FenceBinding | None:
        """The binding proven for the connection ``connection_key`` stands for (see
        :attr:`HostTransaction.connection_key`), ``None`` when it was not proven yet."""
        ...

    def deposed(
        self, workflow_id: str, expected: bytes | None = None, observed: bytes | None = None
    ) -> NoReturn:
        """Report the deposition (log, warning) and raise ``EngineDeposedError``; a block that
        read the epoch passes the bytes it expected and the ones it ``observed``."""
        ...

    def end_refused(
        self, workflow_id: str, expected: bytes | None, observed: bytes | None
    ) -> NoReturn:
        """Raise for a block whose end check (``FenceBinding.end_check``) read ``observed``
        instead of ``expected``, once the block rolled back: the transaction was ended inside
        the block (``StorageError``), or the engine was deposed (``EngineDeposedError``)."""
        ...

    def failed(self, workflow_id: str, exc: BaseException) -> StorageError:
        """The error for a statement of the fence that failed with ``exc``."""
        ...

    def store_replaced(self, workflow_id: str, exc: StoreIdentityError) -> NoReturn:
        """Raise ``exc`` for a block whose store check (``FenceBinding.store_check``) failed,
        once the block rolled back; every claim of the engine is lost first."""
        ...

    def generic_block(self, workflow_id: str, connection: object) -> AbstractContextManager[object]:
        """The block every connection gets: where the fast block does not apply."""
        ...


FastBlockFactory = Callable[[FenceContext, str, Any], AbstractContextManager[object]]
"""A family's fast block for one connection type: ``factory(fence, workflow_id, connection)``,
which handles the usual case itself and hands any other to ``fence.generic_block``."""
