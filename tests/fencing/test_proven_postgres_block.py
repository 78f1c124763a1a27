"""PostgreSQL: the short path of a proven connection keeps the generic block's guarantees.

A psycopg 3 connection the fence proved before takes ``PsycopgBlock``; a psycopg2 connection in
autocommit mode sends ``BEGIN`` and the epoch read as one query. Each must still bound its lock
wait, refuse a deposed engine, roll back on an exception and leave the connection idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import pytest

from tests.fencing.hosts import HostEnv, make_env
from tests.fencing.race import store_table
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning

pytestmark = pytest.mark.postgres_only

WID = "wf-1"
DRIVERS = ["psycopg", "psycopg2-autocommit", "psycopg2"]


class _Recording(psycopg2.extensions.cursor):
    """A cursor that notes each statement its connection runs, before running it."""

    def execute(self, query: Any, vars: Any = None) -> None:
        self.connection.sent.append(str(query))
        super().execute(query, vars)


class _RecordingConnection(psycopg2.extensions.connection):
    """A psycopg2 connection whose every cursor (the fence's own too) is a recording one."""

    sent: list[str]

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["cursor_factory"] = _Recording
        return super().cursor(*args, **kwargs)


@pytest.fixture
def env(postgres_base_url: str, tmp_path: Path) -> Iterator[HostEnv]:
    host = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        yield host
    finally:
        host.close()


def _connect(env: HostEnv, driver: str) -> Any:
    if driver == "psycopg":
        return env.connect("psycopg")
    conn = psycopg2.connect(env.db_url, connection_factory=_RecordingConnection)
    conn.sent = []
    conn.autocommit = driver == "psycopg2-autocommit"
    return conn


def _idle(conn: Any) -> bool:
    if isinstance(conn, psycopg.Connection):
        return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    return bool(conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE)


def _proven(env: HostEnv, driver: str, **kwargs: Any) -> tuple[Ownership, Any]:
    own = env.ownership(**kwargs)
    assert own.registry.acquire(WID).status == "acquired"
    conn = _connect(env, driver)
    with own.fenced(WID, conn):  # proves the connection
        env.write(conn, "proof", "0", driver="psycopg")
    return own, conn


def test_psycopg2_autocommit_proven_block_sends_begin_with_the_read_and_the_check_with_commit(
    env: HostEnv,
) -> None:
    own, conn = _proven(env, "psycopg2-autocommit")
    try:
        conn.sent.clear()
        with own.fenced(WID, conn):
            env.write(conn, "r", "1", driver="psycopg2")
        first, write, end = conn.sent
        assert first.startswith("BEGIN; SELECT") and "FOR SHARE" in first, conn.sent
        assert "INSERT INTO" in write, conn.sent
        assert "weft_sync.fenced" in end and end.endswith("; COMMIT"), conn.sent
        assert _idle(conn)
    finally:
        conn.close()
    assert env.rows() == {"proof": "0", "r": "1"}


def test_psycopg2_proven_block_in_a_transaction_keeps_begin_apart(env: HostEnv) -> None:
    """psycopg2's implicit ``BEGIN``, or a savepoint inside an open transaction: nothing merged."""
    own, conn = _proven(env, "psycopg2")
    try:
        conn.sent.clear()
        with own.fenced(WID, conn):
            env.write(conn, "r", "1", driver="psycopg2")
        assert conn.sent[0].startswith("SELECT") and "FOR SHARE" in conn.sent[0], conn.sent
        # psycopg2 ends its implicit transaction with commit(): the end check goes before it.
        assert "weft_sync.fenced" in conn.sent[-1] and "COMMIT" not in conn.sent[-1], conn.sent
        conn.autocommit = True
        conn.cursor().execute("BEGIN")
        conn.sent.clear()
        with own.fenced(WID, conn):
            env.write(conn, "inner", "2", driver="psycopg2")
        assert conn.sent[0].startswith("SAVEPOINT"), conn.sent
        conn.cursor().execute("COMMIT")
    finally:
        conn.close()
    assert env.rows() == {"proof": "0", "r": "1", "inner": "2"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_proven_block_lock_wait_is_bounded(env: HostEnv, driver: str) -> None:
    options = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)
    own, conn = _proven(env, driver, options=options)
    blocker = psycopg.connect(env.db_url)
    try:
        blocker.execute(
            f"SELECT value FROM {store_table(env)} WHERE key = %s FOR UPDATE",
            [keys.workflow_owner_epoch(WID)],
        )
        with pytest.raises(StorageError, match="lock timeout"), own.fenced(WID, conn):
            pytest.fail("the fence went ahead without its lock")
        assert _idle(conn)
        blocker.rollback()
        with own.fenced(WID, conn):
            env.write(conn, "after", "ok", driver="psycopg")
    finally:
        blocker.close()
        conn.close()
    assert env.rows() == {"proof": "0", "after": "ok"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_proven_block_of_a_deposed_engine_writes_nothing(env: HostEnv, driver: str) -> None:
    own, conn = _proven(env, driver)
    try:
        env.take_over(WID)
        with (
            pytest.warns(WorkflowClaimLostWarning),
            pytest.raises(EngineDeposedError),
            own.fenced(WID, conn),
        ):
            env.write(conn, "late", "x", driver="psycopg")
        assert _idle(conn)
    finally:
        conn.close()
    assert env.rows() == {"proof": "0"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_proven_block_rolls_back_on_an_exception(env: HostEnv, driver: str) -> None:
    own, conn = _proven(env, driver)
    try:
        with pytest.raises(KeyError), own.fenced(WID, conn):
            env.write(conn, "lost", "x", driver="psycopg")
            raise KeyError("host")
        assert _idle(conn)
        with own.fenced(WID, conn):
            env.write(conn, "kept", "y", driver="psycopg")
    finally:
        conn.close()
    assert env.rows() == {"proof": "0", "kept": "y"}
