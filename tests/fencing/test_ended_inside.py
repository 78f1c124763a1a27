"""A host that ends the fenced transaction inside the block gets nothing unfenced committed.

The scenario of every test: engine A holds the workflow and opens a fenced block; inside, the
host writes ``r1``, ends the transaction (its driver's ``commit()``, or a ``COMMIT`` statement),
engine B then takes the workflow over for real (A's claim expired on the ``ManualClock``), and
the host writes ``r2``. ``r1`` committed before the takeover, which is the host's doing; ``r2``
is a deposed owner's write and must not commit through the block: its exit rolls back what is
open and raises. Each case runs on a connection's first block (the generic block, which proves
it) and on a proven one (the family's short path).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import pytest

from tests.fencing.hosts import HostEnv, make_env
from weft_sync import Ownership
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning

WID = "wf-ended"

ENDED = "ended inside the block"
"""What the error of a block whose transaction was ended inside it says."""


def _env(request: pytest.FixtureRequest, tmp_path: Path, backend: str, driver: str) -> HostEnv:
    base = request.getfixturevalue("postgres_base_url") if backend == "postgres" else None
    return make_env(backend, driver, tmp_path, base)


@pytest.fixture
def pg_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HostEnv]:
    host = _env(request, tmp_path, "postgres", "psycopg")
    try:
        yield host
    finally:
        host.close()


@pytest.fixture
def lite_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HostEnv]:
    host = _env(request, tmp_path, "sqlite", "sqlite3")
    try:
        yield host
    finally:
        host.close()


def _owner(env: HostEnv, conn: Any, driver: str, proven: bool) -> Ownership:
    """Engine A, holding ``WID``; its first block on ``conn`` already ran when ``proven``."""
    own = env.ownership()
    assert own.registry.acquire(WID).status == "acquired"
    if proven:
        with own.fenced(WID, conn) as yielded:
            env.write(yielded, "r0", "proof", driver=driver)
        assert env.rows() == {"r0": "proof"}
    return own


def _ended_then_deposed(
    env: HostEnv, own: Ownership, conn: Any, driver: str, end: Callable[[Any], object]
) -> BaseException:
    """Run the scenario; return what the block's exit raised (the test fails if nothing)."""
    with pytest.raises((EngineDeposedError, StorageError)) as err, own.fenced(WID, conn) as yielded:
        env.write(yielded, "r1", "before the takeover", driver=driver)
        end(yielded)
        env.take_over(WID)  # the lock went with the host's commit: B takes over for real
        env.write(yielded, "r2", "deposed", driver=driver)
    return err.value


def _assert_refused(err: BaseException, env: HostEnv, proven: bool) -> None:
    assert isinstance(err, EngineDeposedError) or ENDED in str(err), repr(err)
    rows = env.rows()
    assert "r2" not in rows, rows
    assert rows.get("r1") == "before the takeover", rows
    assert ("r0" in rows) is proven


# -- sqlite3 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
@pytest.mark.parametrize("how", ["commit()", "COMMIT"])
def test_sqlite3_commit_inside_then_a_takeover_commits_nothing_after_it(
    lite_env: HostEnv, proven: bool, how: str
) -> None:
    env = lite_env
    conn: sqlite3.Connection = env.connect()
    own = _owner(env, conn, "sqlite3", proven)

    def end(c: sqlite3.Connection) -> None:
        if how == "commit()":
            c.commit()
        else:
            c.execute("COMMIT")

    with pytest.warns(WorkflowClaimLostWarning):
        err = _ended_then_deposed(env, own, conn, "sqlite3", end)
    _assert_refused(err, env, proven)
    assert not conn.in_transaction


# -- psycopg2 ------------------------------------------------------------------------------------


def _pg2_idle(conn: Any) -> bool:
    return bool(conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE)


@pytest.mark.postgres_only
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_psycopg2_commit_inside_then_a_takeover_commits_nothing_after_it(
    pg_env: HostEnv, proven: bool
) -> None:
    env = pg_env
    conn = env.connect("psycopg2")
    own = _owner(env, conn, "psycopg2", proven)
    err = _ended_then_deposed(env, own, conn, "psycopg2", lambda c: c.commit())
    _assert_refused(err, env, proven)
    assert _pg2_idle(conn)


@pytest.mark.postgres_only
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_psycopg2_autocommit_commit_call_inside_keeps_the_fence(
    pg_env: HostEnv, proven: bool
) -> None:
    """In autocommit mode psycopg2's ``commit()`` does nothing: the fence's transaction (its
    explicit ``BEGIN``) stays open, so the takeover cannot happen inside the block."""
    env = pg_env
    conn = env.connect("psycopg2")
    conn.autocommit = True
    own = _owner(env, conn, "psycopg2", proven)
    with own.fenced(WID, conn):
        env.write(conn, "r1", "fenced", driver="psycopg2")
        conn.commit()
        status = conn.get_transaction_status()
        assert status == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
        assert "r1" not in env.rows()
        env.write(conn, "r2", "fenced", driver="psycopg2")
    assert {"r1", "r2"} <= env.rows().keys()
    assert _pg2_idle(conn)


@pytest.mark.postgres_only
@pytest.mark.parametrize("autocommit", [False, True], ids=["implicit", "autocommit"])
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_psycopg2_commit_statement_inside_is_reported(
    pg_env: HostEnv, proven: bool, autocommit: bool
) -> None:
    """A ``COMMIT`` statement ends the transaction behind psycopg2's back: its next statement
    runs on its own (committed at once by the server, out of any block's reach). The block's
    exit still refuses to end quietly."""
    env = pg_env
    conn = env.connect("psycopg2")
    conn.autocommit = autocommit
    own = _owner(env, conn, "psycopg2", proven)

    def end(c: Any) -> None:
        with c.cursor() as cur:
            cur.execute("COMMIT")

    err = _ended_then_deposed(env, own, conn, "psycopg2", end)
    assert ENDED in str(err), repr(err)
    rows = env.rows()
    assert rows.get("r1") == "before the takeover", rows
    # psycopg2 sent r2 outside any transaction: PostgreSQL committed it when it ran.
    assert rows.get("r2") == "deposed", rows
    assert _pg2_idle(conn)


# -- psycopg 3 -----------------------------------------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.parametrize("autocommit", [False, True], ids=["implicit", "autocommit"])
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_psycopg_commit_call_inside_is_refused_by_psycopg_or_by_the_block(
    pg_env: HostEnv, proven: bool, autocommit: bool
) -> None:
    """In psycopg's transaction block (a connection's first block, or any in autocommit mode)
    psycopg refuses the ``commit()``: nothing of the block commits. A proven connection outside
    autocommit mode runs the block in psycopg's implicit transaction, whose ``commit()`` psycopg
    allows: what the host wrote after it, after a takeover, is refused at the block's end."""
    env = pg_env
    conn = psycopg.connect(env.db_url, autocommit=autocommit)
    try:
        own = _owner(env, conn, "psycopg", proven)
        if proven and not autocommit:
            err = _ended_then_deposed(env, own, conn, "psycopg", lambda c: c.commit())
            _assert_refused(err, env, proven)
        else:
            with (
                pytest.raises(psycopg.ProgrammingError, match=r"Explicit commit\(\) forbidden"),
                own.fenced(WID, conn),
            ):
                env.write(conn, "r1", "fenced", driver="psycopg")
                conn.commit()
            assert "r1" not in env.rows()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()


@pytest.mark.postgres_only
@pytest.mark.parametrize("autocommit", [False, True], ids=["implicit", "autocommit"])
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_psycopg_commit_statement_inside_then_a_takeover(
    pg_env: HostEnv, proven: bool, autocommit: bool
) -> None:
    env = pg_env
    conn = psycopg.connect(env.db_url, autocommit=autocommit)
    try:
        own = _owner(env, conn, "psycopg", proven)
        err = _ended_then_deposed(
            env, own, conn, "psycopg", lambda c: c.execute("COMMIT", prepare=False)
        )
        assert ENDED in str(err), repr(err)
        rows = env.rows()
        assert rows.get("r1") == "before the takeover", rows
        # In autocommit mode psycopg sent r2 outside any transaction: committed as it ran.
        assert ("r2" in rows) is autocommit, rows
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()


# -- SQLAlchemy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.parametrize("kind", ["sqlalchemy-connection", "sqlalchemy-session"])
@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_sqlalchemy_commit_inside_then_a_takeover_commits_nothing_after_it(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, kind: str, proven: bool
) -> None:
    env = _env(request, tmp_path, backend, kind)
    try:
        conn = env.connect()
        own = _owner(env, conn, kind, proven)
        warns = pytest.warns(WorkflowClaimLostWarning) if backend == "sqlite" else _nothing()
        with warns:
            err = _ended_then_deposed(env, own, conn, kind, lambda c: c.commit())
        _assert_refused(err, env, proven)
        assert not conn.in_transaction()
    finally:
        env.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- savepoints ----------------------------------------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_commit_inside_a_savepoint_block_commits_nothing_after_it(
    pg_env: HostEnv, driver: str
) -> None:
    """Inside the host's own transaction the block is a savepoint: a commit inside it ends the
    savepoint too. The block refuses to release it, and nothing after the commit commits."""
    env = pg_env
    conn = env.connect(driver)
    own = _owner(env, conn, driver, True)
    env.write(conn, "outer", "host", driver=driver)  # the host's transaction is open
    with pytest.raises((StorageError, psycopg.Error, psycopg2.Error)), own.fenced(WID, conn):
        env.write(conn, "r1", "before the takeover", driver=driver)
        if driver == "psycopg":
            conn.execute("COMMIT")  # psycopg refuses commit() inside its savepoint too
        else:
            conn.commit()
        env.take_over(WID)
        env.write(conn, "r2", "deposed", driver=driver)
    conn.rollback()  # the host's own transaction, after the block's error
    rows = env.rows()
    assert "r2" not in rows and rows.get("r1") == "before the takeover", rows
