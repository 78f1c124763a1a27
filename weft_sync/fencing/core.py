"""The host-data fence: the host's own statements and the epoch check in one transaction.

:func:`fenced_transaction` begins a transaction on the host's connection (a savepoint inside one
already open), proves that it reaches the store's table (once per connection, or on SQLite by
re-checking the last proof on every block), checks under a lock that the store's epoch for the
workflow is exactly the bytes this engine's registry holds, yields, checks that it still may
commit (below), and commits on normal exit or rolls back on an exception.

**PostgreSQL.** The epoch row is read with ``SELECT … FOR SHARE`` in the host's transaction. Every
writer of an epoch row — a takeover, an acquire, an external rotation, a release or a ledger
fenced write, all of which lock the rows they judge with ``SELECT … FOR UPDATE`` (or update them)
— must wait until the host's transaction ends, and then judges the epoch afresh (READ COMMITTED
re-checks a row it waited for). So either the takeover waits for the host's commit, or the host
was already deposed and is refused here: a takeover can never commit between the check and the
host's commit. ``FOR SHARE`` (not ``FOR UPDATE``) lets several fenced transactions of the owner
run at once, and ``FOR KEY SHARE`` would be too weak (a plain ``UPDATE`` of the value does not
wait for it). A renewal updates only the holder row, which the fence does not lock, so this
engine keeps renewing the workflow — and every other claim it holds — while a fenced transaction
is open. A waiting takeover locks epoch rows only (they sort before every holder row, and rows are
locked in key order), so it never blocks a renewal either.

A host transaction at REPEATABLE READ or SERIALIZABLE whose snapshot predates a change of the
epoch row fails that read with a serialization error (``StorageError``): it fails closed.

Waits are bounded on both sides. The locking read itself sets, for the rest of the transaction
(``set_config(…, true)``, as ``SET LOCAL``), ``lock_timeout`` (the claim's renew interval by
default), so neither the fence's lock nor the host's later statements wait for a lock longer than
that, and ``idle_in_transaction_session_timeout`` (the claim TTL by default), so the server ends
the session of a host that stalls inside the block (a stopped process, a forgotten transaction):
its writes roll back, its commit fails, and the takeover goes ahead. A store's own statements
give up waiting for a row lock after the store's ``lock_timeout`` (see
:class:`~weft_sync.storage.PostgresStorage`), so a takeover held up by a long host transaction
fails with ``StorageError`` and is retried by a later reclaim pass instead of stalling that pass.

**SQLite.** The fenced transaction holds SQLite's database write lock from its first statement
(``BEGIN IMMEDIATE``, or a no-op ``UPDATE`` of the epoch row inside a transaction already open,
which also fails if that transaction's snapshot is stale). No other writer of the file — a
takeover in any process included — can commit until the host's transaction ends. The fence does
not take the store's cross-process ``flock``: the library's writer takes the flock and then waits
for SQLite's write lock (bounded by its busy timeout), and the host's transaction holds only
SQLite's lock and never waits for the flock, so no cycle can form. While the host's transaction
is open every write to the file waits, this engine's renewals included; a renewal that waits
longer than the store's busy timeout fails, keeps its claim, and is retried on the next pass, so
a fenced transaction shorter than ``claim_ttl - claim_renew_interval`` costs no claim.

**The end of the block.** The lock lasts as long as the transaction the block began: a host that
ends it inside the block (a driver's ``commit()``, a ``COMMIT`` statement) lets a takeover commit,
and its next statement may begin another transaction. So just before it commits, every block
runs its end check (``FenceBinding.end_check``) in the transaction about to commit. PostgreSQL:
the epoch read set a transaction-local mark (:data:`~weft_sync.storage.fence_proof.PG_FENCE_MARK`),
which only the transaction the block began still has. The check and ``COMMIT`` go as one query
where the fence ends the transaction itself (psycopg2 after the block's explicit ``BEGIN``; a
proven psycopg 3 connection outside autocommit mode, see :mod:`~weft_sync.fencing.psycopg`);
every other case (psycopg 3 in autocommit mode or in a first block, psycopg2's implicit
transaction, SQLAlchemy, Django) sends the check as one more round trip before the driver's own
commit.
SQLite: the epoch row is re-read, under the write lock that any transaction which wrote holds
(one more statement, no round trip), so a transaction the host began after its commit is
committed only while the epoch is still this engine's. A failed check rolls back what is open
and raises ``StorageError`` (the transaction was ended inside the block) or
:class:`~weft_sync.errors.EngineDeposedError` (the epoch changed); a savepoint block, inside a
transaction of the host's, checks the same way before its ``RELEASE``. What the host committed
itself before a takeover stays committed, and a statement its driver ran outside any
transaction (after a ``COMMIT`` statement in autocommit mode, or on psycopg2, which does not see
one) committed as it ran: no fence can take those back, and the block still raises.

**Inside the block** write through the connection, not through the store: a ledger write
(``ownership.workflows``) waits for the block's own lock — SQLite's write lock, or on
PostgreSQL the epoch row's share lock when it is for the same workflow — and fails with
``StorageError`` after the store's busy timeout or ``lock_timeout``.

The same-database proof and the lock statements come from the store
(:class:`~weft_sync.storage.fence_proof.FenceTarget`); this module never looks inside a backend.

A connection family may bring a fast block of its own for its usual case (an adapter's
``fast_block``; sqlite3's :class:`~weft_sync.fencing.sqlite3.Sqlite3Block`): the same steps for
that case with nothing in between, through :class:`HostFence` as its
:class:`~weft_sync.fencing.base.FenceContext`, and any other case handed to the generic block.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import NoReturn

from .. import keys
from ..claims.registry import ClaimRegistry
from ..errors import (
    EngineDeposedError,
    StorageCapabilityError,
    StorageError,
    StoreIdentityError,
    WorkflowClaimLostWarning,
)
from ..storage.base import Storage
from ..storage.fence_proof import FenceBinding, FenceTarget
from .adapters import FAST_BLOCKS, adapt
from .base import HostTransaction, as_value, ended_inside, first_value

_log = logging.getLogger(__name__)

FEATURE = "Ownership.fenced()"

# Guards _PROOFS: per physical connection, the binding of every store it was proven against.
# (A connection that cannot be weakly referenced keeps no proof; its engine's HostFence keeps
# the binding last proven as a first guess, which the binding's confirm() re-proves each block.)
_proofs_lock = threading.Lock()
_PROOFS: weakref.WeakKeyDictionary[object, dict[FenceTarget, FenceBinding]] = (
    weakref.WeakKeyDictionary()
)

# The key's percent-encoding costs more than the rest of the fence's Python work; a host
# fences the same few workflows over and over.
_epoch_key = functools.lru_cache(maxsize=1024)(keys.workflow_owner_epoch)


def _target(storage: Storage) -> FenceTarget:
    # getattr rather than isinstance(storage, SupportsHostFence): a protocol check costs more
    # than the rest of the fence's Python work.
    fence_target = getattr(storage, "fence_target", None)
    if not callable(fence_target):
        raise StorageCapabilityError(
            FEATURE,
            "host_fence",
            f"{type(storage).__name__} cannot fence a host's own tables; use SqliteStorage or "
            f"PostgresStorage with the host's tables in the same database",
        )
    target: FenceTarget = fence_target()
    return target


class ForeignDatabaseError(StorageCapabilityError):
    """The host connection is not on the store's database (a :class:`StorageCapabilityError`
    with capability ``"same_database"``).

    :param connection: the type name of the host's connection.
    :param where: the database the connection is on.
    :param store: the store's database.
    """

    def __init__(self, connection: str, where: str, store: str) -> None:
        super().__init__(FEATURE, "same_database")
        self.where = where
        self.store = store
        message = (
            f"{FEATURE} refused: the connection ({connection}) is on {where}, but the store is "
            f"{store}; the host's tables must be in the store's database, so that the fence and "
            f"the host's writes are one transaction"
        )
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])


def _refuse(host: HostTransaction, target: FenceTarget, where: str) -> NoReturn:
    raise ForeignDatabaseError(type(host.result).__name__, where, target.location)


def _prove(fence: HostFence, host: HostTransaction, target: FenceTarget) -> FenceBinding:
    """Prove ``host`` reaches ``target``'s table and remember how (per connection, or as
    ``fence``'s next first guess when the connection cannot be weakly referenced)."""
    bound = target.bind(host.query)
    if isinstance(bound, str):
        _refuse(host, target, bound)
    conn_key = _weakly_referenceable(host.connection_key)
    if conn_key is None:
        fence.hint = bound
    else:
        with _proofs_lock:
            _PROOFS.setdefault(conn_key, {})[target] = bound
    return bound


def _weakly_referenceable(obj: object | None) -> object | None:
    if obj is None:
        return None
    try:
        weakref.ref(obj)
    except TypeError:
        return None  # e.g. sqlite3.Connection: its proof is cheap enough to run every time
    return obj


def _deposed(workflow_id: str, warn: Callable[[Warning], None]) -> NoReturn:
    _log.warning(
        "a fenced host transaction for workflow %r found this engine deposed (its epoch fence "
        "no longer holds); nothing was written",
        workflow_id,
    )
    warn(WorkflowClaimLostWarning(workflow_id))
    raise EngineDeposedError(workflow_id)


def _end_quietly(host: HostTransaction, error: BaseException) -> None:
    try:
        host.end(error)
    except Exception:
        # The error that ended the block is the one the host needs to see.
        _log.warning("could not roll back a fenced host transaction", exc_info=True)


def fenced_transaction(
    connection: object,
    workflow_id: str,
    storage: Storage,
    registry: ClaimRegistry,
    *,
    warn: Callable[[Warning], None],
    lock_timeout_ms: int | None = None,
    idle_timeout_ms: int | None = None,
) -> AbstractContextManager[object]:
    """Run the block as one transaction on ``connection`` with the epoch check for ``workflow_id``.

    A one-off :class:`HostFence`; an engine keeps one (``Ownership.fenced`` uses it).

    :param connection: the host's connection (see :func:`~weft_sync.fencing.adapters.adapt`).
    :param storage: the store holding the claims; ``connection`` must be on its database.
    :param registry: the engine's registry, which holds the epoch bytes to compare.
    :param warn: receives :class:`~weft_sync.errors.WorkflowClaimLostWarning` on deposition.
    :param lock_timeout_ms: PostgreSQL: ``lock_timeout`` of the fenced transaction; default the
        registry's renew interval.
    :param idle_timeout_ms: PostgreSQL: its ``idle_in_transaction_session_timeout``; default the
        registry's claim TTL.
    :returns: (as the block's value) ``connection`` as given.
    :raises TypeError: ``connection`` is not an accepted connection type.
    :raises StorageCapabilityError: the store cannot fence, or ``connection`` is on another
        database (or SQL family) than the store.
    :raises EngineDeposedError: the claim is not held or the stored epoch is not this engine's;
        nothing of the block was written (the block did not run). Or, on exit, the end check
        found another epoch (SQLite, in a transaction the host began inside the block after
        ending the block's): that transaction was rolled back.
    :raises StorageError: one of the fence's own statements failed (a lock wait timed out, the
        SQLite file stayed locked), or the host ended the transaction inside the block (its end
        check failed); the transaction was rolled back.
    """
    fence = HostFence(
        storage,
        registry,
        warn=warn,
        lock_timeout_ms=lock_timeout_ms,
        idle_timeout_ms=idle_timeout_ms,
    )
    return fence.block(workflow_id, connection)


class HostFence:
    """One engine's host-data fence: what every fenced block of the engine shares.

    It keeps the store's :class:`FenceTarget` once fetched, the parameters of the PostgreSQL
    transaction settings, and the last proof of a connection that keeps none of its own, so
    that a block does no more than its own checks and statements. Its two mutable attributes
    (the target, the hint) are each replaced whole, so a race sets one twice, never halfway.

    :param storage: the store holding the claims.
    :param registry: the engine's registry, which holds the epoch bytes to compare.
    :param warn: receives :class:`~weft_sync.errors.WorkflowClaimLostWarning` on deposition.
    :param lock_timeout_ms: see :func:`fenced_transaction`.
    :param idle_timeout_ms: see :func:`fenced_transaction`.
    :param epoch_of: how a block reads the registry's epoch bytes; default
        ``registry.current_epoch_bytes`` (``Ownership``, which checks the calling process
        itself, passes ``registry.epoch_lookup()``).

    It is the :class:`~weft_sync.fencing.base.FenceContext` of a family's fast block.
    """

    __slots__ = (
        "_extra",
        "_registry",
        "_settings",
        "_storage",
        "_target",
        "_warn",
        "epoch_of",
        "hint",
    )

    def __init__(
        self,
        storage: Storage,
        registry: ClaimRegistry,
        *,
        warn: Callable[[Warning], None],
        lock_timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        epoch_of: Callable[[str], bytes | None] | None = None,
    ) -> None:
        self._storage = storage
        self._registry = registry
        self.epoch_of = registry.current_epoch_bytes if epoch_of is None else epoch_of
        self._warn = warn
        lock_ms = registry.claim_renew_interval_ms if lock_timeout_ms is None else lock_timeout_ms
        idle_ms = registry.claim_ttl_ms if idle_timeout_ms is None else idle_timeout_ms
        self._settings = (f"{lock_ms:d}ms", f"{idle_ms:d}ms")
        self._target: FenceTarget | None = None
        # What the epoch read takes after the key: the settings on PostgreSQL (set with target).
        self._extra: tuple[str, ...] = ()
        # The binding last proven on a connection that keeps no proof of its own (sqlite3):
        # only a guess, confirmed by every block. Set whole; read without a lock.
        self.hint: FenceBinding | None = None

    def block(self, workflow_id: str, connection: object) -> AbstractContextManager[object]:
        """The fenced block for ``workflow_id`` on ``connection`` (:func:`fenced_transaction`):
        the connection family's fast block where it has one, else the generic block; open to
        the ledger's final writes (:func:`open_fence_writes`) while it runs."""
        fast = FAST_BLOCKS.get(type(connection))
        if fast is not None:
            return _OpenBlock(fast(self, workflow_id, connection), self, workflow_id, connection)
        return _OpenBlock(
            _FencedBlock(self, workflow_id, connection), self, workflow_id, connection
        )

    def generic_block(self, workflow_id: str, connection: object) -> AbstractContextManager[object]:
        """The generic fenced block, for any accepted connection."""
        return _FencedBlock(self, workflow_id, connection)

    def proof_for(self, connection_key: object | None) -> FenceBinding | None:
        """The binding proven for the connection ``connection_key`` stands for, or for one
        that keeps no proof of its own the last one proven (a guess to re-check); ``None`` when
        there is none yet. Once :meth:`target` was fetched."""
        target = self._target
        if target is None:
            return None
        key = _weakly_referenceable(connection_key)
        if key is None:
            return self.hint
        with _proofs_lock:
            return _PROOFS.get(key, {}).get(target)

    def read_params(self, workflow_id: str) -> tuple[str, ...]:
        """The epoch read's parameters for ``workflow_id``, once :meth:`target` was fetched."""
        return (_epoch_key(workflow_id), *self._extra)

    def deposed(
        self, workflow_id: str, expected: bytes | None = None, observed: bytes | None = None
    ) -> NoReturn:
        """Raise :class:`~weft_sync.errors.EngineDeposedError`; report a loss found here.

        With no claim held (the loss, if any, was reported when the claim was dropped) it only
        raises, naming the recent cause. Otherwise the block read another token than
        ``expected`` (default: the token held now): the claim is dropped from the registry,
        so its next renewal does not report it again, and reported here once — unless what
        the block ``observed`` shows the store went back in time, which the registry reports.
        """
        registry = self._registry
        token = self.epoch_of(workflow_id) if expected is None else expected
        if token is None:
            if registry.current_epoch_bytes(workflow_id) is not None:
                why = "superseded"  # held, at another epoch than the calling drive's
            else:
                why = registry.loss_cause(workflow_id) or "not_held"
            _log.info(
                "a fenced host transaction for workflow %r was refused: this engine holds no "
                "claim on it (%s); nothing was written",
                workflow_id,
                why,
            )
            raise EngineDeposedError(workflow_id, why)
        if registry.lose_deposed(workflow_id, token, observed, judge=expected is not None):
            _deposed(workflow_id, self._warn)
        raise EngineDeposedError(workflow_id, registry.loss_cause(workflow_id) or "deposed")

    def end_refused(
        self, workflow_id: str, expected: bytes | None, observed: bytes | None
    ) -> NoReturn:
        """Raise for a block whose end check read ``observed`` instead of ``expected`` (the
        block rolled back first): on PostgreSQL no row means the host ended the transaction
        inside the block (:func:`~weft_sync.fencing.base.ended_inside`); any other epoch is a
        deposition (:meth:`deposed`).

        :raises StorageError: the transaction was ended inside the block.
        :raises EngineDeposedError: another epoch is in the store now.
        """
        if observed is None and self.target().family == "postgresql":
            raise ended_inside(workflow_id)
        self.deposed(workflow_id, expected, observed)

    def failed(self, workflow_id: str, exc: BaseException) -> StorageError:
        """The ``StorageError`` for one of the fence's own statements that failed with ``exc``."""
        return _fence_failed(workflow_id, self.target(), exc)

    def store_replaced(self, workflow_id: str, exc: StoreIdentityError) -> NoReturn:
        """Raise ``exc``, the store check's (``FenceBinding.store_check``), once the block
        rolled back: another file is at the store's path, so nothing this engine holds is
        vouched for, and every claim is lost (cause ``store_identity``)."""
        _log.warning(
            "a fenced host transaction for workflow %r was rolled back: %s", workflow_id, exc
        )
        self._registry.lose_store(exc)
        raise exc

    def target(self) -> FenceTarget:
        """The store's fence target, fetched on first use.

        :raises StorageCapabilityError: the store cannot fence a host's tables.
        """
        target = self._target
        if target is None:
            target = _target(self._storage)
            self._extra = self._settings if target.family == "postgresql" else ()
            self._target = target
        return target


class _FencedBlock:
    """One fenced block: checks and begins on entry, checks again and commits, or rolls back,
    on exit.

    A class rather than a generator context manager: the fence is on the path of every host
    write it guards, and a generator's set-up costs more than all of this module's own work.
    """

    __slots__ = ("_binding", "_connection", "_expected", "_fence", "_host", "_wid")

    def __init__(self, fence: HostFence, workflow_id: str, connection: object) -> None:
        self._fence = fence
        self._wid = workflow_id
        self._connection = connection
        self._host: HostTransaction | None = None
        self._binding: FenceBinding | None = None
        self._expected: bytes | None = None

    def _find(self, connection_key: object | None) -> FenceBinding | None:
        # What begin_reading() looks the binding up with: kept for the end check.
        binding = self._binding = self._fence.proof_for(connection_key)
        return binding

    def __enter__(self) -> object:
        fence = self._fence
        wid = self._wid
        host = adapt(self._connection)
        target = fence._target or fence.target()
        if host.family != target.family:
            _refuse(host, target, f"a {host.family!r} database")
        expected = fence.epoch_of(wid)  # validates the id
        if expected is None:
            fence.deposed(wid)
        params = fence.read_params(wid)
        rows = None
        # A host that can begin and read in one call finds its proof itself: asking for the
        # connection (key) may begin a transaction (a Session), so only it knows when to ask.
        begin_reading = getattr(host, "begin_reading", None)
        if begin_reading is not None:
            try:
                rows = begin_reading(self._find, params)
            except Exception as exc:
                _end_quietly(host, exc)
                raise _fence_failed(wid, target, exc) from exc
        observed: bytes | None
        if rows is None:
            self._binding, observed = _begin_and_read(fence, host, target, params, wid)
        else:
            observed = first_value(rows[0] if rows else None)
        if observed != expected:
            error = EngineDeposedError(wid)
            _end_quietly(host, error)
            fence.deposed(wid, expected, observed)
        self._host = host
        self._expected = expected
        return host.result

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        host, self._host = self._host, None
        if host is None:
            return
        if exc is not None:
            _end_quietly(host, exc)
            return
        binding = self._binding
        assert binding is not None
        commit_checked = getattr(host, "commit_checked", None)
        if commit_checked is not None and commit_checked(binding, self._wid):
            return
        _end_check(self._fence, host, binding, self._wid, self._expected)
        host.end(None)


def _end_check(
    fence: HostFence, host: HostTransaction, binding: FenceBinding, wid: str, expected: bytes | None
) -> None:
    """Check, just before the block commits, that it still may (``binding.end_check``); else
    roll back and raise (:meth:`HostFence.end_refused`).

    :raises Exception: the driver's error when the check itself failed (an aborted
        transaction: the host's own error, swallowed); rolled back.
    """
    try:
        rows = host.query(binding.end_check, fence.read_params(wid)[:1])
    except BaseException as exc:
        _end_quietly(host, exc)
        raise
    observed = first_value(rows[0] if rows else None)
    if observed != expected:
        _end_quietly(host, ended_inside(wid))
        fence.end_refused(wid, expected, observed)
    if binding.store_check is not None:
        try:
            binding.store_check()
        except StoreIdentityError as exc:
            _end_quietly(host, exc)
            fence.store_replaced(wid, exc)


def _begin_and_read(
    fence: HostFence,
    host: HostTransaction,
    target: FenceTarget,
    params: tuple[str, ...],
    wid: str,
) -> tuple[FenceBinding, bytes | None]:
    """Begin, prove the connection where its proof is not known to hold, and read the epoch.

    :returns: the binding the read went through, and the epoch it read.
    :raises StorageError: the begin or a statement of the fence failed (rolled back).
    """
    locked = _begin(host, target, wid)
    try:
        binding = fence.proof_for(host.connection_key)
        return _read_epoch(fence, host, target, binding, params, wid, locked=locked)
    except BaseException as exc:
        _end_quietly(host, exc)
        raise


def _begin(host: HostTransaction, target: FenceTarget, wid: str) -> bool:
    """``host.begin()``, a driver's failure (a SQLite file that stayed locked) as StorageError.

    :raises ValueError: the connection cannot be fenced as configured (SQLAlchemy AUTOCOMMIT).
    """
    try:
        return host.begin()
    except (StorageCapabilityError, TypeError, ValueError):
        raise
    except Exception as exc:
        raise _fence_failed(wid, target, exc) from exc


def _fence_failed(wid: str, target: FenceTarget, exc: BaseException) -> StorageError:
    return StorageError(
        f"the fence of a host transaction for workflow {wid!r} failed on {target.location}: {exc}"
    )


def _read_epoch(
    fence: HostFence,
    host: HostTransaction,
    target: FenceTarget,
    binding: FenceBinding | None,
    params: tuple[str, ...],
    wid: str,
    *,
    locked: bool,
) -> tuple[FenceBinding, bytes | None]:
    """Prove the connection, take the lock and read the epoch, inside the begun transaction.

    :raises StorageError: a statement of the fence failed (the caller rolls back).
    """
    try:
        if binding is None or not _still_holds(host, binding):
            binding = _prove(fence, host, target)
        if not locked and binding.write_lock is not None:
            host.query(binding.write_lock, params[:1])
        rows = host.query(binding.read_epoch, params)
    except (StorageCapabilityError, TypeError):
        raise
    except Exception as exc:
        raise _fence_failed(wid, target, exc) from exc
    return binding, first_value(rows[0] if rows else None)


def _still_holds(host: HostTransaction, binding: FenceBinding) -> bool:
    """Whether a cached binding still fits ``host``'s connection (see ``FenceBinding.recheck``)."""
    if binding.recheck is None or binding.confirm is None:
        return True  # proven for this connection's lifetime
    return binding.confirm(host.query(binding.recheck, ()))


# -- the ledger's final writes inside an open fenced block -----------------------------------------

# Per thread, the fenced blocks open on it, innermost last (each an _OpenBlock).
_open_blocks = threading.local()

EndHook = Callable[[bool], None]
"""Told whether the host's transaction that carried a final write committed."""


class _OpenBlock:
    """A fenced block (fast or generic) made visible to this thread's ledger while it runs.

    On exit the inner block commits or rolls back first; then the end hooks of the final writes
    made inside it learn which: a commit that raised, or an exception, is a rollback. A block
    whose host transaction commits later (Django's ``atomic``: its host object has
    ``defer_end_hooks``) hands its hooks on instead.
    """

    __slots__ = ("_fence", "_hooks", "_host", "_inner", "_wid", "connection")

    def __init__(
        self,
        inner: AbstractContextManager[object],
        fence: HostFence,
        workflow_id: str,
        connection: object,
    ) -> None:
        self._inner = inner
        self._fence = fence
        self._wid = workflow_id
        self.connection = connection
        self._hooks: list[EndHook] = []
        self._host: HostStoreWrites | None = None

    def __enter__(self) -> object:
        value = self._inner.__enter__()
        stack: list[_OpenBlock] | None = getattr(_open_blocks, "stack", None)
        if stack is None:
            stack = _open_blocks.stack = []
        stack.append(self)
        return value

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack: list[_OpenBlock] = _open_blocks.stack
        if stack and stack[-1] is self:
            stack.pop()
        else:  # exited out of order: still never left visible
            with contextlib.suppress(ValueError):
                stack.remove(self)
        hooks, self._hooks = self._hooks, []
        try:
            self._inner.__exit__(exc_type, exc, tb)
        except BaseException:
            _run_hooks(hooks, False)
            raise
        defer = getattr(self.connection, "defer_end_hooks", None)
        if callable(defer) and hooks and exc is None:
            defer(hooks)
            return
        _run_hooks(hooks, exc is None)

    @property
    def inner(self) -> AbstractContextManager[object]:
        """The fenced block itself (the family's fast block, or the generic one)."""
        return self._inner

    def writes(self) -> HostStoreWrites:
        """The store's table as this block's host transaction sees it (proven on first use)."""
        if self._host is None:
            self._host = HostStoreWrites(self._fence, self._wid, self.connection, self._hooks)
        return self._host


def _run_hooks(hooks: list[EndHook], committed: bool) -> None:
    for hook in hooks:
        try:
            hook(committed)
        except Exception:
            _log.exception("a fenced block's end hook raised; ignored")


class HostStoreWrites:
    """Reads and writes of the store's table through the host's open fenced transaction.

    The ledger's ``complete()``/``fail()`` inside ``Ownership.fenced()`` write the workflow's
    final state with it, so that the host's rows and the workflow's end commit together. Reads
    lock the row on PostgreSQL (``FOR UPDATE``); on SQLite the block holds the write lock.

    :raises StorageCapabilityError: the store gives the fence no statements to write with.
    """

    __slots__ = ("_binding", "_hooks", "_host", "_wid")

    def __init__(
        self, fence: HostFence, workflow_id: str, connection: object, hooks: list[EndHook]
    ) -> None:
        host = adapt(connection)
        target = fence.target()
        binding = fence.proof_for(host.connection_key)
        if binding is None or not _still_holds(host, binding):
            binding = _prove(fence, host, target)
        if binding.read_value is None or binding.put_value is None or binding.delete_value is None:
            raise StorageCapabilityError(FEATURE, "host_fence_writes")
        self._host = host
        self._binding = binding
        self._wid = workflow_id
        self._hooks = hooks

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` as the host's transaction sees it (row locked on PostgreSQL)."""
        assert self._binding.read_value is not None
        rows = self._host.query(self._binding.read_value, (key,))
        return as_value(rows[0][0]) if rows else None

    def put(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` in the host's transaction."""
        assert self._binding.put_value is not None
        self._host.query(self._binding.put_value, (key, value))

    def delete(self, key: str) -> None:
        """Delete ``key`` in the host's transaction."""
        assert self._binding.delete_value is not None
        self._host.query(self._binding.delete_value, (key,))

    def on_end(self, hook: EndHook) -> None:
        """Call ``hook(committed)`` once the host's transaction committed or rolled back."""
        self._hooks.append(hook)


def open_fence_writes(workflow_id: str, storage: Storage) -> HostStoreWrites | None:
    """The writes of the innermost fenced block open on this thread for ``workflow_id`` over
    ``storage``'s table, or ``None`` when no such block is open here."""
    stack: list[_OpenBlock] | None = getattr(_open_blocks, "stack", None)
    if not stack:
        return None
    for block in reversed(stack):
        if block._wid == workflow_id and block._fence._storage is storage:
            return block.writes()
    return None
