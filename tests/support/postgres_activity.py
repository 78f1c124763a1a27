"""Whether a PostgreSQL session sits inside a transaction: a paused process may hold row locks.

The gunicorn and contention tests pause a process (``SIGSTOP``) between its writes, not inside
one, so that it holds no lock the others need; on PostgreSQL they ask the server.
"""

from __future__ import annotations

import time
import urllib.parse

import psycopg

SETTLE_S = 0.05
"""Waited before asking: a transaction that was committing when the process stopped ends."""


def dsn_of(storage_url: str) -> tuple[str, str | None]:
    """The libpq DSN of a ``postgresql://…?table=…`` store URL, and its ``table``."""
    base, _, query = storage_url.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    table = params.pop("table", None)
    return base + ("?" + urllib.parse.urlencode(params) if params else ""), table


def idle_in_transaction(dsn: str, *, table: str | None = None) -> bool:
    """Whether another session of ``dsn``'s database has sat inside a transaction for over
    40 ms; with ``table``, only one whose last statement named that table."""
    time.sleep(SETTLE_S)
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
        "AND datname = current_database() AND state LIKE 'idle in transaction%%' "
        "AND now() - state_change > interval '40 milliseconds'"
    )
    params: list[object] = []
    if table is not None:
        sql += " AND query LIKE %s"
        params.append(f"%{table}%")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    return bool(row and row[0])
