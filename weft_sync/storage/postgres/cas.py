"""PostgreSQL conditional writes: how ``PostgresStorage`` judges and applies its batches.

Internal to :mod:`weft_sync.storage.postgres.store`, whose class docstring states the contract (one
READ COMMITTED transaction per call, row locks taken in key order, ``INSERT … ON CONFLICT DO
NOTHING`` for keys required absent, a SAVEPOINT per batch that could fail after writing):
:class:`ConditionalWrites` holds ``PostgresStorage``'s ``conditional_batch``,
``conditional_batches`` and ``compare_and_set_many`` and the statements behind them, decided by a
:class:`~weft_sync.storage.postgres.sql.Plan`. No Python lock is taken here: each call runs on a
connection it borrows for itself, and the server's row locks, held until commit or rollback,
guard the rows it judges.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final

import psycopg
from psycopg.rows import TupleRow

from ..._fork import process_bound
from ..base import Batch, Condition, Operation, check_batch_shape, validate_batch
from ..cas import CasRow, cas_batches, validate_cas_rows
from ..read_then_write import Decide
from ..reads import validate_keys
from .locked import renewal_rows
from .sql import Plan, Queries, disjoint, renewal_keys

_Conn = psycopg.Connection[TupleRow]

# Written into a key that a batch requires absent but does not write; deleted before commit.
_PLACEHOLDER: Final = b""


class _Refused(Exception):
    """A conditional batch failed after it had written; its transaction or savepoint rolls back."""


class ConditionalWrites:
    """The conditional-batch methods of ``PostgresStorage``, kept beside their backend."""

    _q: Queries
    _fork_pid: int

    if TYPE_CHECKING:  # defined by the storage class this is mixed into

        def _check_open(self) -> None: ...

        def _write_transaction(self, action: str) -> AbstractContextManager[_Conn]: ...

        def _writing(self, action: str, *, atomic: bool) -> AbstractContextManager[_Conn]: ...

    @process_bound
    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        conds, ops = validate_batch(conditions, operations)
        if renewal_keys([(conds, ops)]) is not None:
            return self._renew([(conds, ops)], "conditional_batch")[0]
        if not conds and not ops:
            self._check_open()
            return True
        plan = Plan.build(conds, ops)
        try:
            with self._write_transaction("conditional_batch") as conn:
                return self._run(conn, plan, savepoint=False)
        except _Refused:
            return False

    @process_bound
    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        checked: list[tuple[list[Condition], list[Operation]]] = []
        for item in batches:
            checked.append(validate_batch(*check_batch_shape(item)))
        if not checked:
            self._check_open()
            return []
        if renewal_keys(checked) is not None:
            return self._renew(checked, "conditional_batches")
        plans = [Plan.build(conds, ops) for conds, ops in checked]
        if disjoint(plans):
            return self._run_disjoint(plans)
        with self._writing("conditional_batches", atomic=True) as conn:
            return [self._run(conn, plan, savepoint=True) for plan in plans]

    @process_bound
    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        """Set each ``(key, expected, new)`` row's key to ``new`` if it holds ``expected``.

        Rows on distinct keys run as one ``UPDATE … FROM unnest(…)``; rows repeating a key are
        applied one after another as conditional batches, in one transaction. See
        :class:`~weft_sync.storage.cas.SupportsCompareAndSetMany`.
        """
        checked = validate_cas_rows(rows)
        if not checked:
            self._check_open()
            return []
        if len({row[0] for row in checked}) == len(checked):
            return self._update_rows(checked, "compare_and_set_many")
        return self.conditional_batches(cas_batches(checked))

    @process_bound
    def read_then_write(
        self, keys: Sequence[str], decide: Decide
    ) -> tuple[list[bytes | None], bool]:
        """Lock and read ``keys``, then apply the batch ``decide`` makes of them, in one
        transaction. See :class:`~weft_sync.storage.read_then_write.SupportsReadThenWrite`.

        Present keys are held by ``SELECT … FOR UPDATE``; a key read as absent is held by the
        batch's insert of it (a concurrent insert makes the batch fail, as in
        ``conditional_batch``). Keys the batch judges beyond ``keys`` are locked after them (name
        them in ``keys`` to lock every row in one order); keys it only writes are locked by the
        write.
        """
        checked = validate_keys(keys)
        read_set = set(checked)
        read = sorted(read_set)
        values: list[bytes | None] = []
        try:
            with self._write_transaction("read_then_write") as conn:
                found = self._lock_rows(conn, read)
                values = [found.get(key) for key in checked]
                decision = decide(list(values))
                if decision is None:
                    return values, False
                plan = Plan.build(*validate_batch(*decision))
                # Keys the batch only writes need no lock first: the write takes it.
                judged = {c.key for c in plan.conditions}
                unread = [k for k in plan.lock_keys if k in judged and k not in read_set]
                found.update(self._lock_rows(conn, unread))
                return values, self._apply_plan(conn, plan, found)
        except _Refused:
            return values, False

    def _lock_rows(self, conn: _Conn, keys: list[str]) -> dict[str, bytes]:
        """Lock the rows of ``keys`` (sorted) that exist; return their values."""
        if not keys:
            return {}
        statement, params = self._q.lock_rows(keys)
        rows = conn.execute(statement, params, binary=True).fetchall()
        return {str(k): bytes(v) for k, v in rows}

    def _apply_plan(self, conn: _Conn, plan: Plan, found: dict[str, bytes]) -> bool:
        """Judge ``plan`` against the locked rows ``found`` and apply it (no savepoint).

        :raises _Refused: it failed after writing; the caller rolls its transaction back.
        """
        if not plan.holds(found):
            return False
        if plan.absent:
            self._claim_and_write(conn, plan, found)
        else:
            self._write(conn, plan.put_keys, plan.put_values, plan.delete_keys)
        return True

    def _renew(
        self, batches: Sequence[tuple[list[Condition], list[Operation]]], action: str
    ) -> list[bool]:
        """Apply renewal-shaped batches on distinct keys with one UPDATE (atomic by itself)."""
        return self._update_rows(renewal_rows(batches), action)

    def _update_rows(self, rows: list[CasRow], action: str) -> list[bool]:
        """Apply compare-and-set rows on distinct keys with one ``UPDATE … FROM unnest(…)``.

        The rows are sent in key order, so concurrent updates lock shared rows in one order.
        """
        ordered = sorted(rows, key=lambda row: row[0])
        with self._writing(action, atomic=False) as conn:
            cur = conn.execute(
                self._q.renew,
                [[r[0] for r in ordered], [r[1] for r in ordered], [r[2] for r in ordered]],
            )
            renewed = {str(row[0]) for row in cur.fetchall()}
        return [row[0] in renewed for row in rows]

    def _run_disjoint(self, plans: list[Plan]) -> list[bool]:
        """Judge and apply plans on pairwise disjoint keys with one lock and one write.

        No plan reads a key another one writes, so judging them all against the rows locked at
        once is exactly judging them one after another; the writes of the plans that hold go out
        together, in key order (keys without a row are not locked by the SELECT: inserting them
        in one order keeps concurrent callers from deadlocking on them).
        """
        lock_keys = sorted(key for plan in plans for key in plan.lock_keys)
        puts: list[tuple[str, bytes]] = []
        delete_keys: list[str] = []
        with self._writing("conditional_batches", atomic=True) as conn:
            rows = conn.execute(self._q.lock, [lock_keys], binary=True).fetchall()
            found = {str(k): bytes(v) for k, v in rows}
            results = [plan.holds(found) for plan in plans]
            for plan, ok in zip(plans, results, strict=True):
                if ok:
                    puts += zip(plan.put_keys, plan.put_values, strict=True)
                    delete_keys += plan.delete_keys
            puts.sort(key=lambda put: put[0])
            delete_keys.sort()
            self._write(conn, [k for k, _ in puts], [v for _, v in puts], delete_keys)
        return results

    def _run(self, conn: _Conn, plan: Plan, *, savepoint: bool) -> bool:
        """Judge and apply one plan inside the caller's transaction.

        :raises _Refused: the batch failed after writing and ``savepoint`` is false; the caller
            must roll its transaction back.
        """
        found: dict[str, bytes] = {}
        if plan.lock_keys:
            found = self._lock_rows(conn, plan.lock_keys)
            if not plan.holds(found):
                return False
        if not plan.absent:
            self._write(conn, plan.put_keys, plan.put_values, plan.delete_keys)
            return True
        if not savepoint:
            self._claim_and_write(conn, plan, found)
            return True
        try:
            with conn.transaction():
                self._claim_and_write(conn, plan, found)
        except _Refused:
            return False
        return True

    def _claim_and_write(self, conn: _Conn, plan: Plan, found: dict[str, bytes]) -> None:
        """Insert the plan's keys required absent and write its puts, in one statement in key
        order, then delete what it deletes.

        :raises _Refused: another transaction created a key the plan requires absent.
        """
        puts = dict(zip(plan.put_keys, plan.put_values, strict=True))
        # A key required absent but not written gets a placeholder row, deleted below: holding its
        # unique-index entry until commit makes a concurrent insert of it wait for this
        # transaction, where a mere re-check would let it land between check and commit.
        rows = sorted(plan.absent.union(puts))
        values = [puts.get(k, _PLACEHOLDER) for k in rows]
        absent = sorted(plan.absent)
        statement, params = self._q.claim_upsert_rows(rows, values, absent)
        returned = conn.execute(statement, params).fetchall()
        written = {str(row[0]) for row in returned}
        if not plan.absent <= written:
            raise _Refused
        placeholders = [k for k in absent if k not in puts]
        if plan.delete_keys or placeholders:
            conn.execute(*self._q.delete_rows(sorted(set(plan.delete_keys).union(placeholders))))

    def _write(
        self, conn: _Conn, put_keys: list[str], put_values: list[bytes], delete_keys: list[str]
    ) -> None:
        if put_keys:
            conn.execute(*self._q.upsert_rows(put_keys, put_values))
        if delete_keys:
            conn.execute(*self._q.delete_rows(delete_keys))
