"""PostgreSQL batched writes that skip rows another session holds locked.

Internal to :mod:`weft_sync.storage.postgres.store` (see :mod:`weft_sync.storage.isolation` for the
contract): :class:`IsolatedBatches` holds ``PostgresStorage``'s two isolated batch methods. Each
function runs its statements on a connection the caller lent and, for
:func:`judge_disjoint_skip_locked`, inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import psycopg

from ...errors import StorageError
from ..base import Batch, Condition, Operation, Put, check_batch_shape, validate_batch
from ..cas import CasRow, cas_batches, validate_cas_rows
from ..isolation import Judged, RowLockedError
from .sql import Plan, Queries, disjoint, renewal_keys


def renewal_rows(batches: Sequence[tuple[list[Condition], list[Operation]]]) -> list[CasRow]:
    """The ``(key, expected, new)`` rows of renewal-shaped batches (see ``renewal_keys``)."""
    rows: list[CasRow] = []
    for conds, ops in batches:
        cond, op = conds[0], ops[0]
        if cond.expected is not None and isinstance(op, Put):
            rows.append((cond.key, cond.expected, op.value))
    return rows


def update_rows_skip_locked(conn: Any, queries: Queries, rows: list[CasRow]) -> list[Judged]:
    """Apply compare-and-set rows on distinct keys with one statement, skipping locked rows.

    The rows are sent in key order, as the waiting variant sends them.
    """
    ordered = sorted(rows, key=lambda row: row[0])
    cur = conn.execute(
        queries.renew_skip_locked,
        [[r[0] for r in ordered], [r[1] for r in ordered], [r[2] for r in ordered]],
    )
    judged = {str(k): (bool(applied), bool(locked)) for k, applied, locked in cur.fetchall()}
    results: list[Judged] = []
    for key, _, _ in rows:
        applied, locked = judged[key]
        results.append(RowLockedError(key) if locked else applied)
    return results


def judge_disjoint_skip_locked(
    conn: Any, queries: Queries, plans: list[Plan]
) -> tuple[list[Judged], list[tuple[str, bytes]], list[str]]:
    """Lock what can be locked at once and judge each plan (pairwise disjoint keys) against it.

    A plan naming a row another session holds is reported locked and left out. Runs inside the
    caller's transaction, which must then write the returned puts and deletes (in key order).

    :returns: each plan's result, the puts and the deletes of the plans that hold.
    """
    lock_keys = sorted(key for plan in plans for key in plan.lock_keys)
    rows = conn.execute(queries.lock_skip_locked, [lock_keys, lock_keys], binary=True).fetchall()
    found: dict[str, bytes] = {}
    busy: set[str] = set()
    for key, value, locked in rows:
        if locked:
            busy.add(str(key))
        else:
            found[str(key)] = bytes(value)
    results: list[Judged] = []
    puts: list[tuple[str, bytes]] = []
    deletes: list[str] = []
    for plan in plans:
        held = next((k for k in plan.lock_keys if k in busy), None)
        if held is not None:
            results.append(RowLockedError(held))
            continue
        ok = plan.holds(found)
        results.append(ok)
        if ok:
            puts += zip(plan.put_keys, plan.put_values, strict=True)
            deletes += plan.delete_keys
    puts.sort(key=lambda put: put[0])
    deletes.sort()
    return results, puts, deletes


def lock_timed_out(exc: StorageError) -> bool:
    """Whether ``exc`` is the server giving up on a lock wait (``lock_timeout``, SQLSTATE 55P03)."""
    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def caused_by(results: list[Judged], waited: StorageError) -> list[Judged]:
    """Give every ``RowLockedError`` in ``results`` the lock wait that gave up as its cause."""
    for slot in results:
        if isinstance(slot, RowLockedError):
            slot.__cause__ = waited
    return results


class _Host(Protocol):
    """What :class:`IsolatedBatches` needs of the storage it is mixed into."""

    _q: Queries

    def _check_open(self) -> None: ...

    def _writing(self, action: str, *, atomic: bool) -> AbstractContextManager[Any]: ...

    def _update_rows(self, rows: list[CasRow], action: str) -> list[bool]: ...

    def _run_disjoint(self, plans: list[Plan]) -> list[bool]: ...

    def _write(
        self, conn: Any, put_keys: list[str], put_values: list[bytes], delete_keys: list[str]
    ) -> None: ...

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]: ...


class IsolatedBatches:
    """``PostgresStorage``'s :class:`~weft_sync.storage.isolation.SupportsIsolatedBatches`."""

    def compare_and_set_many_isolated(self: _Host, rows: Sequence[CasRow]) -> list[Judged]:
        """:meth:`compare_and_set_many`, isolating rows another session holds locked.

        See :class:`~weft_sync.storage.isolation.SupportsIsolatedBatches`. The rows first go out
        as :meth:`compare_and_set_many` sends them (one waiting ``UPDATE``, the fast path); only
        if that hits ``lock_timeout`` do they go again as one statement that skips the rows it
        cannot lock, each reported as a ``RowLockedError``. Rows repeating a key run as
        :meth:`compare_and_set_many` does.
        """
        checked = validate_cas_rows(rows)
        if not checked:
            self._check_open()
            return []
        if len({row[0] for row in checked}) != len(checked):
            return list(self.conditional_batches(cas_batches(checked)))
        try:
            return list(self._update_rows(checked, "compare_and_set_many"))
        except StorageError as exc:
            if not lock_timed_out(exc):
                raise
            waited = exc
        with self._writing("compare_and_set_many", atomic=False) as conn:
            return caused_by(update_rows_skip_locked(conn, self._q, checked), waited)

    def conditional_batches_isolated(self: _Host, batches: Sequence[Batch]) -> list[Judged]:
        """:meth:`conditional_batches`, isolating batches on rows another session holds locked.

        See :class:`~weft_sync.storage.isolation.SupportsIsolatedBatches`. Renewal-shaped lists
        and batches on disjoint keys are isolated as in :meth:`compare_and_set_many_isolated`;
        any other list runs as :meth:`conditional_batches` does (failing as a whole).
        """
        checked = [validate_batch(*check_batch_shape(item)) for item in batches]
        if not checked:
            self._check_open()
            return []
        if renewal_keys(checked) is not None:
            return IsolatedBatches.compare_and_set_many_isolated(self, renewal_rows(checked))
        plans = [Plan.build(conds, ops) for conds, ops in checked]
        if not disjoint(plans):
            return list(self.conditional_batches(checked))
        try:
            return list(self._run_disjoint(plans))
        except StorageError as exc:
            if not lock_timed_out(exc):
                raise
            waited = exc
        with self._writing("conditional_batches", atomic=True) as conn:
            results, puts, deletes = judge_disjoint_skip_locked(conn, self._q, plans)
            self._write(conn, [k for k, _ in puts], [v for _, v in puts], deletes)
        return caused_by(results, waited)
