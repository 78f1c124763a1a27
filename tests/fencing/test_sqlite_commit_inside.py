"""A ``sqlite3`` host that commits or rolls back inside a fenced block, with no takeover.

``test_ended_inside`` has the takeovers; here the engine still owns the workflow, so what the
block finds at its end decides. With the default (deferred) isolation level the host's next write
begins a new transaction, whose write lock the block's end check then holds: the block commits it,
because the epoch it re-reads under that lock is still this engine's. With
``isolation_level=None`` the statements after a ``COMMIT`` run outside any transaction and SQLite
commits each as it runs (the documented limit); the block cannot take them back and raises
``StorageError``, never a bare ``sqlite3`` error. Inside a savepoint block a commit ends the
savepoint too: the block rolls back what followed and raises. Each case runs on a connection's
first block (the generic block) and on a proven one (:class:`Sqlite3Block`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator

import pytest

from tests.fencing.hosts import HostEnv
from weft_sync import Ownership
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning

WID = "wf-commit-inside"
ENDED = "ended inside the block"
NOT_FENCED = "not fenced"

Connect = Callable[[str | None], sqlite3.Connection]


@pytest.fixture
def env(sqlite3_env: HostEnv) -> HostEnv:
    """The cases of this module run on ``sqlite3`` only."""
    return sqlite3_env


@pytest.fixture
def connect(env: HostEnv) -> Iterator[Connect]:
    """Open host connections at an isolation level; closed at the end of the test."""
    opened: list[sqlite3.Connection] = []

    def open_one(isolation: str | None) -> sqlite3.Connection:
        conn = sqlite3.connect(env.db_url, timeout=5.0, isolation_level=isolation)
        opened.append(conn)
        return conn

    yield open_one
    for conn in opened:
        conn.close()


def _owner(env: HostEnv, conn: sqlite3.Connection, proven: bool) -> Ownership:
    own = env.ownership()
    assert own.registry.acquire(WID).status == "acquired"
    if proven:
        with own.fenced(WID, conn):
            env.write(conn, "r0", "proof")
    return own


def _assert_usable(env: HostEnv, own: Ownership, conn: sqlite3.Connection) -> None:
    """Nothing stays begun: the next block on the connection commits."""
    assert not conn.in_transaction
    with own.fenced(WID, conn):
        env.write(conn, "r3", "next block")
    assert env.rows()["r3"] == "next block"


def _end(conn: sqlite3.Connection, how: str) -> None:
    if how == "commit()":
        conn.commit()
    elif how == "rollback()":
        conn.rollback()
    else:
        conn.execute(how)


@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
@pytest.mark.parametrize("how", ["commit()", "rollback()", "COMMIT"])
def test_deferred_write_after_an_inner_commit_is_committed_while_the_epoch_is_ours(
    env: HostEnv, connect: Connect, proven: bool, how: str
) -> None:
    conn = connect("DEFERRED")
    own = _owner(env, conn, proven)
    with own.fenced(WID, conn):
        env.write(conn, "r1", "before")
        _end(conn, how)
        env.write(conn, "r2", "after")  # the module's implicit BEGIN takes the write lock
    rows = env.rows()
    assert rows["r2"] == "after", rows
    assert ("r1" in rows) is (how != "rollback()"), rows
    _assert_usable(env, own, conn)


@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_autocommit_commit_inside_raises_storage_error(
    env: HostEnv, connect: Connect, proven: bool
) -> None:
    conn = connect(None)
    own = _owner(env, conn, proven)
    with pytest.raises(StorageError, match=ENDED) as err, own.fenced(WID, conn):
        env.write(conn, "r1", "before")
        conn.commit()
        env.write(conn, "r2", "outside any transaction")
    assert not isinstance(err.value, sqlite3.Error)
    assert NOT_FENCED in str(err.value)
    # SQLite committed the statement as it ran, outside any transaction: the documented limit.
    assert env.rows()["r2"] == "outside any transaction"
    _assert_usable(env, own, conn)


@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_autocommit_transaction_begun_after_a_commit_is_checked_before_it_commits(
    env: HostEnv, connect: Connect, proven: bool
) -> None:
    """The host's own ``BEGIN`` after its ``COMMIT``: committed while the epoch is ours, rolled
    back with ``EngineDeposedError`` once another engine took the workflow in between."""
    conn = connect(None)
    own = _owner(env, conn, proven)
    with own.fenced(WID, conn):
        env.write(conn, "r1", "before")
        conn.execute("COMMIT")
        conn.execute("BEGIN")
        env.write(conn, "r2", "still ours")
    assert env.rows()["r2"] == "still ours"
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        own.fenced(WID, conn),
    ):
        env.write(conn, "r4", "before the takeover")
        conn.execute("COMMIT")
        env.take_over(WID)
        conn.execute("BEGIN")
        env.write(conn, "r5", "deposed")
    rows = env.rows()
    assert "r5" not in rows and rows["r4"] == "before the takeover", rows
    assert not conn.in_transaction


@pytest.mark.parametrize("how", ["commit()", "rollback()"])
def test_commit_inside_a_savepoint_block_raises_and_rolls_back_what_followed(
    env: HostEnv, connect: Connect, how: str
) -> None:
    """A block inside the host's open transaction is a savepoint; a commit ends it too."""
    conn = connect("DEFERRED")
    own = _owner(env, conn, proven=True)
    env.write(conn, "r0", "the host's transaction, before the block")
    assert conn.in_transaction
    with pytest.raises(StorageError, match=ENDED), own.fenced(WID, conn):
        env.write(conn, "r1", "before")
        _end(conn, how)
        env.write(conn, "r2", "after")
    rows = env.rows()
    assert "r2" not in rows, rows
    assert ("r1" in rows) is (how == "commit()"), rows
    _assert_usable(env, own, conn)
