"""The fenced block on a ``sqlite3.Connection`` once its file is proven: the short path.

After a connection's first block (which proves it), a block on a ``sqlite3.Connection`` outside
a transaction runs :class:`~weft_sync.fencing.sqlite3.Sqlite3Block`'s own steps rather than the
generic block's. Each test proves the connection first, checks that the next block takes the
short path, and then what that path must do exactly as the generic one does.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.fencing.hosts import HostEnv
from weft_sync import Ownership, keys
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning
from weft_sync.fencing.sqlite3 import Sqlite3Block

WID = "wf-1"


@pytest.fixture
def env(sqlite3_env: HostEnv) -> HostEnv:
    """The cases of this module run on ``sqlite3`` only."""
    return sqlite3_env


@pytest.fixture
def own(env: HostEnv) -> Ownership:
    own = env.ownership()
    assert own.registry.acquire(WID).status == "acquired"
    return own


@pytest.fixture
def conn(env: HostEnv, own: Ownership) -> sqlite3.Connection:
    """A host connection proven by one block (which wrote ``row = proven``)."""
    conn: sqlite3.Connection = env.connect()
    with own.fenced(WID, conn):
        env.write(conn, "row", "proven")
    return conn


def _short(own: Ownership, conn: sqlite3.Connection, wid: str = WID) -> Sqlite3Block:
    # The block itself, inside the wrapper that lets complete()/fail() join its transaction.
    block = getattr(own.fenced(wid, conn), "inner", None)
    assert isinstance(block, Sqlite3Block)
    return block


def test_a_proven_block_commits_on_the_short_path(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    block = _short(own, conn)
    with block as yielded:
        assert yielded is conn and conn.in_transaction
        assert block._generic is None  # not handed over
        env.write(conn, "row", "short")
        assert env.rows() == {"row": "proven"}
    assert not conn.in_transaction
    assert env.rows() == {"row": "short"}


def test_an_exception_rolls_the_short_paths_write_back(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    with pytest.raises(ZeroDivisionError), _short(own, conn):
        env.write(conn, "row", "rolled back")
        raise ZeroDivisionError
    assert not conn.in_transaction
    assert env.rows() == {"row": "proven"}


def test_a_commit_inside_the_short_path_is_reported(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    with (
        pytest.raises(StorageError, match="ended inside the block"),
        _short(own, conn),
    ):
        env.write(conn, "row", "committed early")
        conn.commit()
    assert env.rows() == {"row": "committed early"}


def test_an_unheld_claim_is_refused_before_any_statement(
    own: Ownership, conn: sqlite3.Connection
) -> None:
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    with (
        pytest.raises(EngineDeposedError),
        _short(own, conn, "never-claimed"),
    ):
        pytest.fail("the block ran without a claim")
    assert statements == []


def test_a_changed_epoch_is_refused_and_nothing_stays_begun(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    lost: list[str] = []
    own.on_lost(lost.append)
    table = env.storage_url.rsplit("table=", 1)[1]
    with sqlite3.connect(env.db_url) as other:
        other.execute(
            f"UPDATE {table} SET value = x'00' WHERE key = ?", (keys.workflow_owner_epoch(WID),)
        )
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        _short(own, conn),
    ):
        pytest.fail("the block ran with another engine's epoch in the store")
    assert not conn.in_transaction and lost == [WID]


def test_a_failed_epoch_read_is_a_storage_error_and_is_rolled_back(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    table = env.storage_url.rsplit("table=", 1)[1]

    def deny_the_store(action: int, arg1: str | None, *_: object) -> int:
        denied = action == sqlite3.SQLITE_READ and arg1 == table
        return sqlite3.SQLITE_DENY if denied else sqlite3.SQLITE_OK

    conn.set_authorizer(deny_the_store)  # also makes every cached statement prepare again
    with pytest.raises(StorageError, match="prohibited"), _short(own, conn):
        pytest.fail("the block ran without its epoch read")
    assert not conn.in_transaction
    conn.set_authorizer(None)
    with _short(own, conn):
        env.write(conn, "row", "after")
    assert env.rows() == {"row": "after"}


def test_inside_an_open_transaction_the_block_is_handed_to_the_generic_one(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection
) -> None:
    conn.execute("BEGIN")
    env.write(conn, "before", "host")
    block = _short(own, conn)
    with block:
        assert block._generic is not None  # a savepoint of the generic block
        env.write(conn, "row", "nested")
    assert conn.in_transaction  # the host's transaction is the host's to end
    conn.commit()
    assert env.rows() == {"row": "nested", "before": "host"}


def test_a_connection_that_left_the_proven_file_is_handed_over_and_proven_again(
    env: HostEnv, own: Ownership, tmp_path: Path
) -> None:
    """A re-check that fails rolls back and lets the generic block prove the connection: here
    one whose main file is not the store, with the store attached."""
    main = env.connect()
    with own.fenced(WID, main):
        env.write(main, "row", "main")
    other = sqlite3.connect(str(tmp_path / "host-main.db"), isolation_level=None)
    try:
        other.execute("ATTACH DATABASE ? AS weft", (env.db_url,))
        block = _short(own, other)
        with block:
            assert block._generic is not None
            other.execute(f"UPDATE weft.{env.table} SET v = 'attached' WHERE id = 'row'")
    finally:
        other.close()
    assert env.rows() == {"row": "attached"}


def test_a_closed_connection_is_a_storage_error_as_in_its_first_block(
    env: HostEnv, own: Ownership, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    conn.close()
    with pytest.raises(StorageError, match="closed database"), own.fenced(WID, conn):
        pytest.fail("the block ran on a closed connection")
    fresh = env.connect()
    fresh.close()
    with pytest.raises(StorageError, match="closed database"), own.fenced(WID, fresh):
        pytest.fail("the block ran on a closed connection")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
