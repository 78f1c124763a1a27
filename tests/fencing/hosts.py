"""Host databases for the fence tests: the store plus the host's own table, through each driver.

A :class:`HostEnv` is one store (a SQLite file, or a PostgreSQL table) and one host table
``(id TEXT PRIMARY KEY, v TEXT)`` in the same database, reached through one driver: ``sqlite3``,
``psycopg``, ``psycopg2``, or SQLAlchemy (a ``Connection`` or an ORM ``Session``). Its helpers
open host connections, write a row through whichever object a fenced block yields, and read
the table back on a connection of their own.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import sqlalchemy
from sqlalchemy import orm
from sqlalchemy.pool import NullPool

from weft_sync import ManualClock, Ownership, OwnershipOptions

TTL_MS = 3000
RENEW_MS = 1000
START_MS = 1_000_000
PAST_EXPIRY_MS = TTL_MS + 2 * RENEW_MS + 1
"""Advancing the clock by this makes a claim last renewed now takeover-eligible."""

CASES = (
    ("sqlite", "sqlite3"),
    ("sqlite", "sqlalchemy-connection"),
    ("sqlite", "sqlalchemy-session"),
    ("postgres", "psycopg"),
    ("postgres", "psycopg2"),
    ("postgres", "sqlalchemy-connection"),
    ("postgres", "sqlalchemy-session"),
)
UPSERT = "INSERT INTO {t} (id, v) VALUES ({p}, {p}) ON CONFLICT (id) DO UPDATE SET v = excluded.v"


@dataclass
class HostEnv:
    """One store and one host table in the same database, reached through ``driver``."""

    backend: str
    driver: str
    storage_url: str
    db_url: str
    table: str
    clock: ManualClock = field(default_factory=lambda: ManualClock(START_MS))
    _closers: list[Callable[[], object]] = field(default_factory=list)
    _engines: dict[str, sqlalchemy.Engine] = field(default_factory=dict)

    # -- engines ------------------------------------------------------------------------------

    def ownership(self, **kwargs: Any) -> Ownership:
        options = kwargs.pop("options", None) or OwnershipOptions(
            claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS
        )
        own = Ownership.open(
            kwargs.pop("storage", self.storage_url),
            background="manual",
            clock=self.clock,
            options=options,
            **kwargs,
        )
        self._closers.append(own.close)
        return own

    def take_over(self, wid: str) -> Ownership:
        """A second engine takes ``wid`` over once the clock is past the first owner's expiry."""
        other = self.ownership()
        self.clock.advance(PAST_EXPIRY_MS)
        result = other.registry.takeover(wid)
        assert result.status == "acquired", result
        return other

    # -- host connections ---------------------------------------------------------------------

    def _sa_engine(self, flavour: str) -> sqlalchemy.Engine:
        if flavour not in self._engines:
            if self.backend == "sqlite":
                url = "sqlite:///" + self.db_url
            else:
                url = self.db_url.replace("postgresql://", f"postgresql+{flavour}://", 1)
            engine = sqlalchemy.create_engine(url, poolclass=NullPool)
            self._engines[flavour] = engine
            self._closers.append(engine.dispose)
        return self._engines[flavour]

    def connect(self, driver: str | None = None) -> Any:
        """A new host connection (or session) of ``driver`` (default: this env's)."""
        driver = driver or self.driver
        conn: Any
        if driver == "sqlite3":
            conn = sqlite3.connect(self.db_url, timeout=5.0, check_same_thread=False)
        elif driver == "psycopg":
            conn = psycopg.connect(self.db_url)
        elif driver == "psycopg2":
            conn = psycopg2.connect(self.db_url)
        elif driver == "sqlalchemy-connection":
            conn = self._sa_engine("psycopg" if self.backend == "postgres" else "").connect()
        elif driver == "sqlalchemy-session":
            engine = self._sa_engine("psycopg2" if self.backend == "postgres" else "")
            conn = orm.Session(engine)
        else:
            raise ValueError(driver)
        self._closers.append(conn.close)
        return conn

    def placeholder(self, driver: str | None = None) -> str:
        driver = driver or self.driver
        if driver.startswith("sqlalchemy"):
            return ":p"
        return "?" if driver == "sqlite3" else "%s"

    def write(self, conn: Any, row_id: str, value: str, driver: str | None = None) -> None:
        """Upsert ``(row_id, value)`` through ``conn`` (what a fenced block yielded)."""
        driver = driver or self.driver
        if driver.startswith("sqlalchemy"):
            sql = UPSERT.format(t=self.table, p=":p").replace(":p, :p", ":id, :v")
            conn.execute(sqlalchemy.text(sql), {"id": row_id, "v": value})
            return
        sql = UPSERT.format(t=self.table, p=self.placeholder(driver))
        cur = conn.cursor()
        try:
            cur.execute(sql, (row_id, value))
        finally:
            cur.close()

    def rows(self) -> dict[str, str]:
        """The host table as committed, read on a fresh connection."""
        sql = f"SELECT id, v FROM {self.table}"
        if self.backend == "sqlite":
            with sqlite3.connect(self.db_url, timeout=5.0) as conn:
                found = conn.execute(sql).fetchall()
            conn.close()
        else:
            with psycopg.connect(self.db_url) as pconn:
                found = pconn.execute(sql).fetchall()
        return {str(k): str(v) for k, v in found}

    def setup(self) -> None:
        sql = f"CREATE TABLE {self.table} (id TEXT PRIMARY KEY, v TEXT NOT NULL)"
        if self.backend == "sqlite":
            with sqlite3.connect(self.db_url) as conn:
                conn.execute(sql)
            conn.close()
        else:
            with psycopg.connect(self.db_url, autocommit=True) as pconn:
                pconn.execute(sql)

    def close(self) -> None:
        for closer in reversed(self._closers):
            closer()
        self._closers.clear()
        if self.backend == "postgres":
            with psycopg.connect(self.db_url, autocommit=True) as pconn:
                pconn.execute(f"DROP TABLE IF EXISTS {self.table}")


def make_env(backend: str, driver: str, tmp_path: Path, pg_base_url: str | None) -> HostEnv:
    """Build (and create the table of) a fresh :class:`HostEnv`."""
    suffix = uuid.uuid4().hex[:12]
    table = f"host_{suffix}"
    store_table = f"t_{suffix}"
    if backend == "sqlite":
        path = str(tmp_path / "shared.db")
        env = HostEnv(backend, driver, f"sqlite:///{path}?table={store_table}", path, table)
    else:
        assert pg_base_url is not None
        sep = "&" if "?" in pg_base_url else "?"
        env = HostEnv(backend, driver, f"{pg_base_url}{sep}table={store_table}", pg_base_url, table)
    env.setup()
    return env
