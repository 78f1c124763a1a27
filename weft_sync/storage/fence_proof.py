"""What a host-data fence needs from a store: its SQL family, its table, and a same-database proof.

A host that keeps its own tables in the store's database can make its writes one transaction with
the epoch check (:mod:`weft_sync.fencing`). The fence knows nothing about a backend; a store that
supports it hands out a :class:`FenceTarget` from ``fence_target()``, which tells the fence which
SQL family the host connection must speak, and proves — with queries the fence runs on the host's
own connection — that the connection reaches this store's table, and how to name it there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

Family = Literal["sqlite", "postgresql"]
Query = Callable[[str, Sequence[object]], list[tuple[Any, ...]]]
"""Runs one statement on the host connection and returns its rows."""


def quote_identifier(name: str) -> str:
    """Quote an SQL identifier (both families): wrap in double quotes, double the quotes inside."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True, slots=True)
class FenceBinding:
    """How a proven host connection reaches the store's table.

    :param read_epoch: the statement reading one key's value, taking the lock a takeover must
        wait for where the family has row locks. Parameters: the key; on PostgreSQL also the
        ``lock_timeout`` and ``idle_in_transaction_session_timeout`` it sets for the rest of
        the transaction (see :data:`PG_READ_EPOCH`).
    :param write_lock: on SQLite, a statement that takes the database write lock inside an open
        transaction without changing anything (one parameter, the key); ``None`` elsewhere.
    :param recheck: on SQLite, a statement (no parameters) run on every block before the epoch
        read, whose rows :attr:`confirm` judges: whether the connection still has the store's
        file open under the schema ``read_epoch`` names. ``None`` where the proof holds for the
        connection's lifetime (PostgreSQL: a connection never changes its database).
    :param confirm: see ``recheck``.
    :param end_check: the statement a block runs just before it commits (parameter: the key):
        its one row holds the epoch bytes the block read on entry only while the block may
        still commit. On PostgreSQL it reads the epoch only while :data:`PG_FENCE_MARK` is set,
        that is in the transaction the block began (a host that ended it inside the block
        gets no row); on SQLite it re-reads the epoch, under the write lock of any transaction
        that wrote.
    :param commit_checked: on PostgreSQL, the same check and ``COMMIT`` as one simple query (no
        parameters) for a driver that sent the block's ``BEGIN`` itself; it fails with a
        division by zero, committing nothing, when the mark is not set. ``None`` elsewhere.
    :param store_check: on SQLite, the store's own check that the file at its path is still
        the one it opened (``StoreIdentityError`` when not: a restore that renamed another file
        into place, for example, while the host's connection still has the old one open); run
        just before every block commits, after the end check. ``None`` elsewhere.
    :param read_value: put_value: delete_value: read (locking the row where the family has
        row locks), upsert and delete one key of the store's table inside the host's
        transaction (parameters: the key, and the value for ``put_value``); the ledger writes a
        workflow's final state with them when it finishes inside a fenced block.
    """

    read_epoch: str
    end_check: str
    write_lock: str | None = None
    recheck: str | None = None
    confirm: Callable[[Sequence[tuple[Any, ...]]], bool] | None = None
    commit_checked: str | None = None
    store_check: Callable[[], None] | None = None
    read_value: str | None = None
    put_value: str | None = None
    delete_value: str | None = None


@runtime_checkable
class FenceTarget(Protocol):
    """A store's side of the host-data fence."""

    @property
    def family(self) -> Family:
        """The SQL family a host connection must speak: ``"sqlite"`` or ``"postgresql"``."""
        ...

    @property
    def location(self) -> str:
        """The store's database, for messages (never with credentials)."""
        ...

    def bind(self, query: Query) -> FenceBinding | str:
        """Prove that the connection behind ``query`` reaches this store's table.

        :returns: the binding, or a description of the database the connection is on instead
            (for the refusal message).
        """
        ...


@runtime_checkable
class SupportsHostFence(Protocol):
    """A store whose table a host connection to the same database can fence its writes with."""

    def fence_target(self) -> FenceTarget: ...


class SqliteFenceTarget:
    """The SQLite side: the host connection must have the store's file open (main or attached).

    The proof compares the device and inode of every file in ``PRAGMA database_list`` with the
    store's file, so another path to the same file (a symlink, a relative path) is accepted and a
    copy is not. The store's path is resolved when the target is made (when the store opens),
    so a later ``chdir`` cannot point the proof at another file.

    What a sqlite3 connection has open can change between two blocks (``ATTACH``/``DETACH``,
    ``deserialize()``), and a new connection can reuse a closed one's ``id()``, so nothing is
    cached per connection: every block re-checks that the proven schema is still on the store's
    file — by name when SQLite reports the store's own resolved path (the same string names the
    same file), else by device and inode of an absolute path (a deserialized database reports a
    bare name, never a path) — and proves afresh when it is not. The check reads
    ``PRAGMA database_list``, SQLite's documented way to ask a connection which files it has
    open. (Not the ``pragma_database_list`` table-valued function in the epoch read: a
    connection that prepared one crashes SQLite 3.40 after ``deserialize()``.)

    SQLite reports the path a connection opened, not the file it has open now: a connection
    opened before another file was renamed into place still names the path. So every block also
    runs ``store_check`` (the store's identity check, ``stat`` calls only) just before it
    commits: a block on the old file, or on the new one under a store that opened the old one,
    is refused there.
    """

    family: Family = "sqlite"

    def __init__(
        self, path: str, table: str, store_check: Callable[[], None] | None = None
    ) -> None:
        self._path = path
        self._table = table
        self._real = os.path.realpath(path)
        self._store_check = store_check

    @property
    def location(self) -> str:
        return f"SQLite file {self._path!r} (table {self._table!r})"

    def bind(self, query: Query) -> FenceBinding | str:
        store = os.stat(self._real)
        files: list[str] = []
        for _seq, schema, file in query("PRAGMA database_list", ()):
            if not file:
                files.append(f"{schema}: (in memory or temporary)")
                continue
            files.append(f"{schema}: {file!r}")
            if self._is_store(file, store):
                return self._binding(str(schema))
        return "SQLite databases " + ", ".join(files)

    def _is_store(self, file: object, store: os.stat_result | None = None) -> bool:
        if not isinstance(file, str) or not os.path.isabs(file):
            return False  # also a deserialized database's bare name, whatever cwd holds
        if file == self._real:
            return True
        try:
            info = os.stat(file)
            if store is None:
                store = os.stat(self._real)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == (store.st_dev, store.st_ino)

    def _binding(self, schema: str) -> FenceBinding:
        table = f"{quote_identifier(schema)}.{quote_identifier(self._table)}"
        real = self._real

        def confirm(rows: Sequence[tuple[Any, ...]]) -> bool:
            # On every fenced block: a loop rather than any() over a generator, and the usual
            # case (SQLite reports the store's own resolved path) without a stat.
            for row in rows:
                if row[1] == schema:
                    return row[2] == real or self._is_store(row[2])
            return False

        return FenceBinding(
            read_epoch=f"SELECT value FROM {table} WHERE key = ?",
            end_check=f"SELECT value FROM {table} WHERE key = ?",
            write_lock=f"UPDATE {table} SET value = value WHERE key = ?",
            recheck="PRAGMA database_list",
            confirm=confirm,
            store_check=self._store_check,
            read_value=f"SELECT value FROM {table} WHERE key = ?",
            put_value=f"INSERT OR REPLACE INTO {table} (key, value) VALUES (?, ?)",
            delete_value=f"DELETE FROM {table} WHERE key = ?",
        )


@dataclass(frozen=True, slots=True)
class PostgresIdentity:
    """Where a PostgreSQL store's table is: cluster, database, table oid and schema."""

    system_identifier: str
    database: str
    table_oid: int
    schema: str


IDENTITY_SQL = (
    "SELECT (SELECT system_identifier FROM pg_control_system())::text, current_database(), "
    "to_regclass(%s)::oid::bigint"
)
"""One row: the cluster's system identifier, the database and the oid of the named table as
the session's ``search_path`` resolves it (``NULL`` when not visible)."""


PG_FENCE_MARK = "weft_sync.fenced"
"""A transaction-local setting the epoch read sets to ``'1'``: gone once that transaction ends,
so the fence checks at its commit that the transaction it began is still the one open
(:data:`PG_END_CHECK`, :data:`PG_COMMIT_CHECKED`)."""

PG_END_CHECK = (
    f"SELECT value FROM {{table}} WHERE key = %s AND current_setting('{PG_FENCE_MARK}', true) = '1'"
)
"""The epoch row, only while :data:`PG_FENCE_MARK` is set: no row once the host ended the
transaction the block began. (The row itself cannot have changed: the block share-locks it.)"""

PG_COMMIT_CHECKED = (
    f"SELECT 1 / coalesce((current_setting('{PG_FENCE_MARK}', true) = '1')::int, 0); COMMIT"
)
"""The mark's check and ``COMMIT`` in one simple query: without the mark the ``SELECT`` fails
(division by zero), so the ``COMMIT`` never runs and the server rolls back what was open."""

PG_READ_EPOCH = (
    "SELECT value FROM {table} WHERE key = %s "
    "AND set_config('lock_timeout', %s, true) IS NOT NULL "
    "AND set_config('idle_in_transaction_session_timeout', %s, true) IS NOT NULL "
    f"AND set_config('{PG_FENCE_MARK}', '1', true) IS NOT NULL "
    "FOR SHARE"
)
"""Read and share-lock one epoch row; parameters: the key, then the transaction's
``lock_timeout`` and ``idle_in_transaction_session_timeout`` (e.g. ``"5000ms"``).

The settings ride in the row filter so that the fence costs one statement: the filter runs on
the row before the row is locked, so the lock wait already obeys the new ``lock_timeout``; all
are transaction-local (``set_config(…, true)``, as ``SET LOCAL``), :data:`PG_FENCE_MARK` too.
Without an epoch row nothing is set, and the fence refuses the block."""


class PostgresFenceTarget:
    """The PostgreSQL side: same cluster (system identifier), same database, same table.

    The table must be visible under the host session's ``search_path`` as the same relation
    (oid) the store uses; the fence then names it schema-qualified, so a later change of the
    session's ``search_path`` cannot point the fence at another table.
    """

    family: Family = "postgresql"

    def __init__(self, table: str, identity: PostgresIdentity) -> None:
        self._table = table
        self._identity = identity

    @property
    def location(self) -> str:
        ident = self._identity
        return (
            f"PostgreSQL database {ident.database!r} of cluster {ident.system_identifier} "
            f"(table {ident.schema}.{self._table})"
        )

    def bind(self, query: Query) -> FenceBinding | str:
        ((system_identifier, database, oid),) = query(
            IDENTITY_SQL, (quote_identifier(self._table),)
        )
        ident = self._identity
        if (str(system_identifier), str(database)) != (ident.system_identifier, ident.database):
            return f"PostgreSQL database {database!r} of cluster {system_identifier}"
        if oid is None or int(oid) != ident.table_oid:
            return (
                f"PostgreSQL database {database!r} of cluster {system_identifier}, where "
                f"{self._table!r} on the session's search_path is "
                + ("not visible" if oid is None else f"another table (oid {oid})")
            )
        table = f"{quote_identifier(ident.schema)}.{quote_identifier(self._table)}"
        return FenceBinding(
            read_epoch=PG_READ_EPOCH.format(table=table),
            end_check=PG_END_CHECK.format(table=table),
            commit_checked=PG_COMMIT_CHECKED,
            read_value=f"SELECT value FROM {table} WHERE key = %s FOR UPDATE",
            put_value=(
                f"INSERT INTO {table} (key, value) VALUES (%s, %s) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
            ),
            delete_value=f"DELETE FROM {table} WHERE key = %s",
        )
