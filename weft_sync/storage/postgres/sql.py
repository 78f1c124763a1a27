"""PostgreSQL statements and batch plans: what ``PostgresStorage`` sends, decided without I/O."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql

from ..base import Condition, Operation, Put


@dataclass(frozen=True, slots=True)
class Plan:
    """One validated conditional batch, reduced to the rows it locks, claims and writes."""

    conditions: list[Condition]
    lock_keys: list[str]
    absent: frozenset[str]
    put_keys: list[str]
    put_values: list[bytes]
    delete_keys: list[str]

    @classmethod
    def build(cls, conditions: list[Condition], operations: list[Operation]) -> Plan:
        final: dict[str, bytes | None] = {}
        for op in operations:
            final[op.key] = op.value if isinstance(op, Put) else None
        puts = sorted((k, v) for k, v in final.items() if v is not None)
        cond_keys = {c.key for c in conditions}
        return cls(
            conditions=conditions,
            lock_keys=sorted(cond_keys | final.keys()) if conditions else [],
            absent=frozenset(c.key for c in conditions if c.expected is None),
            put_keys=[k for k, _ in puts],
            put_values=[v for _, v in puts],
            delete_keys=sorted(k for k, v in final.items() if v is None),
        )

    def holds(self, found: dict[str, bytes]) -> bool:
        return all(found.get(c.key) == c.expected for c in self.conditions)


Statement = bytes | sql.Composed
"""A statement as ``Queries`` keeps it: composed, or rendered to bytes."""

SCALARS_UP_TO: Final = 8
"""Lists of up to this many keys (or rows) go out as that many scalar parameters, in a statement
rendered once per shape; longer ones as one array parameter each. An array costs the client
several microseconds to dump (psycopg's array dumper, in Python), a scalar a fraction of one."""

# The statements of every read and write: rendered to bytes once a connection is at hand
# (Queries.render), since psycopg renders a composed statement again on every execute.
_RENDERED = (
    "get",
    "get_many",
    "put",
    "delete",
    "upsert_many",
    "claim_upsert",
    "delete_many",
    "lock",
    "renew",
)


class Queries:
    """The SQL statements for one table, composed once (the hot ones rendered once)."""

    def __init__(self, table: str) -> None:
        t = sql.Identifier(table)
        self.create = sql.SQL(
            'CREATE TABLE {t} (key TEXT COLLATE "C" PRIMARY KEY, value BYTEA NOT NULL)'
        ).format(t=t)
        self.get: Statement = sql.SQL("SELECT value FROM {t} WHERE key = %s").format(t=t)
        self.get_many: Statement = sql.SQL(
            "SELECT key, value FROM {t} WHERE key = ANY(%b::text[])"
        ).format(t=t)
        self.put: Statement = sql.SQL(
            "INSERT INTO {t} (key, value) VALUES (%s, %b) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
        ).format(t=t)
        self.delete: Statement = sql.SQL("DELETE FROM {t} WHERE key = %s").format(t=t)
        self.upsert_many: Statement = sql.SQL(_upsert(None)).format(t=t)
        self.claim_upsert: Statement = sql.SQL(_claim_upsert(None, None)).format(t=t)
        self.delete_many: Statement = sql.SQL(_delete(None)).format(t=t)
        self.lock: Statement = sql.SQL(_lock(None)).format(t=t)
        self.renew: Statement = sql.SQL(
            "UPDATE {t} SET value = u.v "
            "FROM unnest(%b::text[], %b::bytea[], %b::bytea[]) AS u(k, e, v) "
            "WHERE {t}.key = u.k AND {t}.value = u.e RETURNING {t}.key"
        ).format(t=t)
        self._rendered_table: bytes | None = None
        self.scan = sql.SQL("SELECT key, value FROM {t}").format(t=t)
        self.table = t
        # The rows another session holds locked are skipped, not waited for: each comes back
        # with applied = false and locked = true (it exists, but this statement could not lock
        # it). MATERIALIZED keeps the locking CTE from being inlined or run twice.
        self.renew_skip_locked = sql.SQL(
            "WITH u AS MATERIALIZED ("
            "SELECT * FROM unnest(%b::text[], %b::bytea[], %b::bytea[]) AS u(k, e, v)), "
            "l AS MATERIALIZED (SELECT {t}.key FROM {t} JOIN u ON {t}.key = u.k "
            "ORDER BY {t}.key FOR UPDATE OF {t} SKIP LOCKED), "
            "w AS (UPDATE {t} SET value = u.v FROM u JOIN l ON l.key = u.k "
            "WHERE {t}.key = u.k AND {t}.value = u.e RETURNING {t}.key) "
            "SELECT u.k, EXISTS (SELECT 1 FROM w WHERE w.key = u.k), "
            "NOT EXISTS (SELECT 1 FROM l WHERE l.key = u.k) "
            "AND EXISTS (SELECT 1 FROM {t} WHERE {t}.key = u.k) FROM u"
        ).format(t=t)
        # Locks what it can at once; ``locked`` marks rows that exist but another session holds.
        self.lock_skip_locked = sql.SQL(
            "WITH l AS MATERIALIZED (SELECT key, value FROM {t} WHERE key = ANY(%b::text[]) "
            "ORDER BY key FOR UPDATE SKIP LOCKED) "
            "SELECT {t}.key, l.value, l.key IS NULL FROM {t} LEFT JOIN l ON l.key = {t}.key "
            "WHERE {t}.key = ANY(%b::text[])"
        ).format(t=t)
        self.identity = sql.SQL(
            "SELECT s.system_identifier::text, current_database(), c.oid::bigint, n.nspname "
            "FROM pg_control_system() AS s, pg_class AS c "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)"
        )

    def render(self, conn: psycopg.Connection[Any]) -> None:
        """Render the statements of every read and write to bytes, with ``conn``'s encoding.

        The table name is ASCII (see ``validate_table_name``), so the bytes serve every
        connection of the store. Idempotent.
        """
        for name in _RENDERED:
            statement = getattr(self, name)
            if isinstance(statement, sql.Composable):
                setattr(self, name, statement.as_bytes(conn))
        self._rendered_table = self.table.as_bytes(conn)

    def lock_rows(self, keys: list[str]) -> tuple[Statement, list[object]]:
        """``SELECT … ORDER BY key FOR UPDATE`` of ``keys`` (not empty), and its parameters."""
        table = self._rendered_table
        if table is None or len(keys) > SCALARS_UP_TO:
            return self.lock, [keys]
        return _scalar_statement(table, _lock, (len(keys),)), list(keys)

    def claim_upsert_rows(
        self, keys: list[str], values: list[bytes], absent: list[str]
    ) -> tuple[Statement, list[object]]:
        """The claim upsert of ``keys``/``values`` sparing the ``absent`` keys (not empty, among
        ``keys``), and its parameters."""
        table = self._rendered_table
        if table is None or len(keys) > SCALARS_UP_TO or not absent:
            return self.claim_upsert, [keys, values, absent]
        statement = _scalar_statement(table, _claim_upsert, (len(keys), len(absent)))
        return statement, [*_pairs(keys, values), *absent]

    def upsert_rows(self, keys: list[str], values: list[bytes]) -> tuple[Statement, list[object]]:
        """The upsert of ``keys``/``values`` (not empty), and its parameters."""
        table = self._rendered_table
        if table is None or len(keys) > SCALARS_UP_TO:
            return self.upsert_many, [keys, values]
        return _scalar_statement(table, _upsert, (len(keys),)), _pairs(keys, values)

    def delete_rows(self, keys: list[str]) -> tuple[Statement, list[object]]:
        """The delete of ``keys`` (not empty), and its parameters."""
        table = self._rendered_table
        if table is None or len(keys) > SCALARS_UP_TO:
            return self.delete_many, [keys]
        return _scalar_statement(table, _delete, (len(keys),)), list(keys)


def _pairs(keys: list[str], values: list[bytes]) -> list[object]:
    """``keys`` and ``values`` interleaved: the scalars of ``(key, value)`` rows."""
    pairs: list[object] = []
    for key, value in zip(keys, values, strict=True):
        pairs += (key, value)
    return pairs


def _keys_in(n: int | None) -> str:
    """Where a key is one of a list: one array (``None``) or ``n`` scalar parameters."""
    if n is None:
        return "= ANY(%b::text[])"
    return "IN (" + ", ".join(["%b"] * n) + ")"


def _rows_from(n: int | None) -> str:
    """``(key, value)`` rows ``u(k, v)`` from two arrays (``None``) or ``n`` pairs of scalars."""
    if n is None:
        return "unnest(%b::text[], %b::bytea[]) AS u(k, v)"
    return "(VALUES " + ", ".join(["(%b::text, %b::bytea)"] * n) + ") AS u(k, v)"


def _lock(n: int | None) -> str:
    return "SELECT key, value FROM {t} WHERE key " + _keys_in(n) + " ORDER BY key FOR UPDATE"


def _upsert(rows: int | None) -> str:
    return (
        "INSERT INTO {t} (key, value) SELECT k, v FROM " + _rows_from(rows) + " "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
    )


def _delete(n: int | None) -> str:
    return "DELETE FROM {t} WHERE key " + _keys_in(n)


def _claim_upsert(rows: int | None, absent: int | None) -> str:
    # Inserts every row and overwrites a present one, except a key of the absent list (one
    # required absent): a conflict there changes nothing and returns no key.
    return (
        "INSERT INTO {t} (key, value) SELECT k, v FROM " + _rows_from(rows) + " "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value "
        "WHERE NOT ({t}.key " + _keys_in(absent) + ") RETURNING key"
    )


@functools.lru_cache(maxsize=1024)
def _scalar_statement(table: bytes, build: Callable[..., str], counts: tuple[int, ...]) -> bytes:
    """The statement ``build`` makes for lists of ``counts`` scalars each, on the rendered
    ``table`` (``functools.lru_cache`` is thread-safe: a shape may be rendered twice, never
    wrongly)."""
    return build(*counts).replace("{t}", table.decode("ascii")).encode("ascii")


def advisory_key(table: str) -> int:
    digest = hashlib.blake2b(f"weft_sync.create:{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def renewal_keys(batches: Sequence[tuple[list[Condition], list[Operation]]]) -> list[str] | None:
    """Return the batch keys if every batch is ``[Condition(k, bytes)] -> [Put(k, v)]`` on
    distinct keys, else ``None``; such batches are independent, so one UPDATE judges them all."""
    keys: list[str] = []
    for conditions, operations in batches:
        if len(conditions) != 1 or len(operations) != 1:
            return None
        cond, op = conditions[0], operations[0]
        if cond.expected is None or not isinstance(op, Put) or op.key != cond.key:
            return None
        keys.append(cond.key)
    return keys if len(set(keys)) == len(keys) else None


def disjoint(plans: list[Plan]) -> bool:
    """Whether ``plans`` (more than one) all lock existing rows only, on pairwise disjoint keys."""
    if len(plans) < 2:
        return False
    seen: set[str] = set()
    for plan in plans:
        if plan.absent or not plan.lock_keys or not seen.isdisjoint(plan.lock_keys):
            return False
        seen.update(plan.lock_keys)
    return True
