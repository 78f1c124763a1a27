"""psycopg 3: the block is psycopg's own transaction, and leaves nothing in the session.

What the server sees is read from libpq's own protocol trace (``PGconn.trace``): each frontend
``Query`` or ``Sync`` message is one round trip. Outside autocommit mode the block is psycopg's
implicit transaction, ended by the end check and ``COMMIT`` in one query; in autocommit mode,
inside an open transaction or in pipeline mode it is psycopg's transaction block (``BEGIN`` or
a savepoint), which refuses a host's ``commit()`` inside it. Either way the block keeps the
connection's isolation level, refuses to commit what a host began after ending the block's
transaction, bounds its lock wait, leaves psycopg's own transaction handling working after it,
and never prepares a statement in the host's session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fencing.hosts import HostEnv, make_env
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning

pytestmark = pytest.mark.postgres_only

WID = "wf-1"


@pytest.fixture
def env(postgres_base_url: str, tmp_path: Path) -> Iterator[HostEnv]:
    host = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        yield host
    finally:
        host.close()


def _held(env: HostEnv, wid: str = WID, **kwargs: Any) -> Ownership:
    own = env.ownership(**kwargs)
    assert own.registry.acquire(wid).status == "acquired"
    return own


@contextmanager
def _traced(conn: psycopg.Connection[Any], tmp_path: Path) -> Iterator[list[str]]:
    """The frontend messages ``conn`` sends inside the ``with`` (filled in on exit)."""
    path = tmp_path / f"trace-{id(conn)}.txt"
    sent: list[str] = []
    with path.open("w") as out:
        conn.pgconn.trace(out.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield sent
        finally:
            conn.pgconn.untrace()
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[0] == "F":
            sent.append(f"{fields[2]} {fields[3] if len(fields) > 3 else ''}".strip())


def _round_trips(sent: list[str]) -> int:
    return sum(1 for message in sent if message.startswith(("Query", "Sync")))


def test_proven_block_is_begin_the_read_and_the_check_with_commit(
    env: HostEnv, tmp_path: Path
) -> None:
    own = _held(env)
    conn = env.connect()
    with own.fenced(WID, conn):  # the first block proves the connection
        env.write(conn, "r0", "a")
    with _traced(conn, tmp_path) as sent, own.fenced(WID, conn):
        pass
    # psycopg's implicit BEGIN, the read, the end check with COMMIT (one simple query)
    assert _round_trips(sent) == 3, sent
    assert "BEGIN" in sent[0] and "FOR SHARE" in sent[1], sent
    assert "weft_sync.fenced" in sent[-1] and "COMMIT" in sent[-1], sent
    assert sent[-1].startswith("Query"), sent  # the simple protocol: two statements, no Parse
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with own.fenced(WID, conn):
        env.write(conn, "r1", "b")
    assert env.rows() == {"r0": "a", "r1": "b"}


def test_proven_autocommit_block_is_psycopgs_transaction_block(
    env: HostEnv, tmp_path: Path
) -> None:
    own = _held(env)
    conn = psycopg.connect(env.db_url, autocommit=True)
    try:
        with own.fenced(WID, conn):
            env.write(conn, "r0", "a")
        with _traced(conn, tmp_path) as sent, own.fenced(WID, conn):
            pass
        # psycopg's BEGIN, the read, the end check, psycopg's COMMIT
        assert _round_trips(sent) == 4, sent
        assert "BEGIN" in sent[0] and "COMMIT" in sent[-1], sent
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()
    assert env.rows() == {"r0": "a"}


def test_psycopg_transaction_handling_works_in_and_after_a_proven_block(env: HostEnv) -> None:
    """The block leaves psycopg nothing stale: inside it a host's ``transaction()`` is a
    savepoint of the block's transaction; after it ``transaction()``, ``commit()``,
    ``rollback()`` and a change of ``autocommit`` work as on a connection never fenced."""
    own = _held(env)
    conn = env.connect()
    with own.fenced(WID, conn):
        env.write(conn, "proof", "1")
    with own.fenced(WID, conn):
        with conn.transaction() as inner:
            assert inner.savepoint_name  # a savepoint of the block's transaction
            env.write(conn, "inner", "1")
        with pytest.raises(KeyError), conn.transaction():
            env.write(conn, "inner-lost", "1")
            raise KeyError("host")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with conn.transaction() as tx:
        assert not tx.savepoint_name  # an outer transaction: psycopg's BEGIN and COMMIT
        env.write(conn, "after", "1")
    env.write(conn, "implicit", "1")
    conn.commit()
    env.write(conn, "rolled back", "1")
    conn.rollback()
    conn.autocommit = True
    conn.autocommit = False
    with own.fenced(WID, conn):
        env.write(conn, "last", "1")
    assert env.rows() == {"proof": "1", "inner": "1", "after": "1", "implicit": "1", "last": "1"}


def test_aborted_proven_block_raises_the_drivers_error_and_rolls_back(env: HostEnv) -> None:
    """A host that swallowed a failed statement leaves the transaction aborted: the end check
    and ``COMMIT`` fail with the server's error, and the block rolls back."""
    own = _held(env)
    conn = env.connect()
    with own.fenced(WID, conn):
        pass
    with pytest.raises(psycopg.errors.InFailedSqlTransaction), own.fenced(WID, conn):
        env.write(conn, "r", "lost")
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table_here")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with own.fenced(WID, conn):
        env.write(conn, "after", "1")
    assert env.rows() == {"after": "1"}


def test_connection_isolation_level_is_kept(env: HostEnv) -> None:
    own = _held(env)
    conn = env.connect()
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = False
    for _ in range(2):
        with own.fenced(WID, conn):
            level = conn.execute("SHOW transaction_isolation").fetchone()
            read_only = conn.execute("SHOW transaction_read_only").fetchone()
        assert level == ("repeatable read",)
        assert read_only == ("off",)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_commit_inside_an_autocommit_block_is_refused(env: HostEnv) -> None:
    own = _held(env)
    conn = psycopg.connect(env.db_url, autocommit=True)
    try:
        with own.fenced(WID, conn):
            env.write(conn, "proven", "1")
        with (
            pytest.raises(psycopg.ProgrammingError, match=r"Explicit commit\(\) forbidden"),
            own.fenced(WID, conn),
        ):
            env.write(conn, "before", "2")
            conn.commit()  # psycopg refuses it inside its transaction block
            env.write(conn, "after", "3")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()
    # The refusal ended the block with an exception: the whole block was rolled back.
    assert env.rows() == {"proven": "1"}


@pytest.mark.parametrize("how", ["commit", "rollback"])
def test_commit_inside_a_proven_block_commits_nothing_after_it(env: HostEnv, how: str) -> None:
    """Outside autocommit mode the block is psycopg's implicit transaction: a host's
    ``commit()`` (or ``rollback()``) inside it ends it, and the block's exit refuses to
    commit the transaction the host's next statement began: rolled back, ``StorageError``."""
    own = _held(env)
    conn = env.connect()
    try:
        with own.fenced(WID, conn):
            env.write(conn, "proven", "1")
        with pytest.raises(StorageError, match="ended inside the block"), own.fenced(WID, conn):
            env.write(conn, "before", "2")
            getattr(conn, how)()
            env.write(conn, "after", "3")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with pytest.raises(StorageError, match="ended inside the block"), own.fenced(WID, conn):
            getattr(conn, how)()  # nothing open at the block's end: nothing sent, refused
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()
    # What the host committed itself, under the block's lock, stays; nothing after it.
    expected = {"proven": "1", "before": "2"} if how == "commit" else {"proven": "1"}
    assert env.rows() == expected


def test_deposed_on_a_proven_connection_writes_nothing(env: HostEnv) -> None:
    old = _held(env)
    conn = env.connect()
    with old.fenced(WID, conn):
        env.write(conn, "r0", "old")
    new = env.take_over(WID)
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        old.fenced(WID, conn),
    ):
        env.write(conn, "r0", "stale")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with new.fenced(WID, conn):
        env.write(conn, "r0", "new")
    assert env.rows() == {"r0": "new"}


def test_lock_wait_on_a_proven_connection_is_bounded(env: HostEnv) -> None:
    own = _held(env, options=OwnershipOptions(claim_ttl=600, claim_renew_interval=200))
    conn = env.connect()
    with own.fenced(WID, conn):
        pass
    table = env.storage_url.rsplit("table=", 1)[1]
    blocker = psycopg.connect(env.db_url)
    try:
        blocker.execute(
            f"SELECT value FROM {table} WHERE key = %s FOR UPDATE",
            [keys.workflow_owner_epoch(WID)],
        )
        with pytest.raises(StorageError, match="lock timeout"), own.fenced(WID, conn):
            pytest.fail("the fence went ahead without its lock")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        blocker.rollback()
        blocker.close()
    with own.fenced(WID, conn):
        env.write(conn, "after", "ok")
    assert env.rows() == {"after": "ok"}


def test_exception_in_a_proven_block_rolls_back(env: HostEnv) -> None:
    own = _held(env)
    conn = env.connect()
    with own.fenced(WID, conn):
        pass
    with pytest.raises(KeyError), own.fenced(WID, conn):
        env.write(conn, "r0", "lost")
        raise KeyError("host")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert env.rows() == {}


@pytest.mark.parametrize("wid", ["it's; DROP TABLE x; --", "wf/ü 1", "a\\b%"])
def test_workflow_ids_with_quotes_and_non_ascii_are_bound_as_values(env: HostEnv, wid: str) -> None:
    own = _held(env, wid)
    conn = env.connect()
    for value in ("1", "2"):
        with own.fenced(wid, conn):
            env.write(conn, "r", value)
    assert env.rows() == {"r": "2"}


def test_open_transaction_and_pipeline_use_a_savepoint(env: HostEnv, tmp_path: Path) -> None:
    own = _held(env)
    conn = env.connect()
    with own.fenced(WID, conn):
        pass
    conn.execute("SELECT 1")  # the implicit transaction of a non-autocommit connection
    with _traced(conn, tmp_path) as sent, own.fenced(WID, conn):
        env.write(conn, "inner", "1")
    assert any("SAVEPOINT" in message for message in sent), sent
    conn.rollback()  # the host's own transaction decides: the savepoint's write goes with it
    with conn.pipeline(), own.fenced(WID, conn):
        env.write(conn, "piped", "1")
    assert env.rows() == {"piped": "1"}


@pytest.mark.parametrize("autocommit", [False, True])
def test_no_statement_is_left_prepared_in_the_hosts_session(
    env: HostEnv, tmp_path: Path, autocommit: bool
) -> None:
    own = _held(env)
    conn = psycopg.connect(env.db_url, autocommit=autocommit)
    try:
        assert conn.prepare_threshold is not None
        # Past psycopg's threshold: a query it ran that often would be prepared unless asked not.
        for value in range(conn.prepare_threshold + 3):
            with own.fenced(WID, conn):
                env.write(conn, "r", str(value))
        with _traced(conn, tmp_path) as sent, own.fenced(WID, conn):
            env.write(conn, "r", "last")
        prepared = conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
        # The host's own upsert may be prepared (psycopg's choice for the host); none of ours.
        ours = [row for row in prepared if "FOR SHARE" in row[0] or "pg_control" in row[0]]
        assert ours == [], prepared
        assert any("INSERT INTO" in row[0] for row in prepared), prepared  # the threshold hit
        conn.rollback()  # the implicit transaction of the query above, when not autocommit
        assert not any("PREPARE" in message for message in sent), sent
        conn.autocommit = True  # DISCARD runs outside a transaction block
        conn.execute("DISCARD ALL")  # as a transaction-mode pooler resets a session
        conn.autocommit = autocommit
        with own.fenced(WID, conn):
            env.write(conn, "r", "after reset")
    finally:
        conn.close()
    assert env.rows() == {"r": "after reset"}


def test_two_stores_fenced_on_one_connection(env: HostEnv, tmp_path: Path) -> None:
    first = _held(env)
    sep = "&" if "?" in env.db_url else "?"
    second_table = f"t2_{env.table}"

    def drop_second() -> None:
        with psycopg.connect(env.db_url, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {second_table}")

    env._closers.append(drop_second)  # runs after the second engine closed (closers: LIFO)
    second = _held(env, "wf-2", storage=f"{env.db_url}{sep}table={second_table}")
    conn = env.connect()
    try:
        for value in ("1", "2"):
            with first.fenced(WID, conn):
                env.write(conn, "a", value)
            with second.fenced("wf-2", conn):
                env.write(conn, "b", value)
        with _traced(conn, tmp_path) as sent:
            with first.fenced(WID, conn):
                pass
            with second.fenced("wf-2", conn):
                pass
        assert not any("PREPARE" in message for message in sent), sent
        assert _round_trips(sent) == 6, sent  # each: BEGIN, the read, the check with COMMIT
    finally:
        conn.close()
    assert env.rows() == {"a": "2", "b": "2"}


def _rolls_back_then_is_refused(
    env: HostEnv, own: Ownership, host: Any, in_transaction: Callable[[], bool]
) -> None:
    """On a proven SQLAlchemy host: an exception rolls the block back, and after a takeover
    the block is refused; neither leaves a transaction open."""
    with pytest.raises(KeyError), own.fenced(WID, host):
        env.write(host, "r", "lost")
        raise KeyError("host")
    assert not in_transaction()
    env.take_over(WID)
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        own.fenced(WID, host),
    ):
        env.write(host, "r", "stale")
    assert not in_transaction()


def test_sqlalchemy_connection_on_psycopg_runs_the_read_unprepared_in_its_transaction(
    postgres_base_url: str, tmp_path: Path
) -> None:
    import sqlalchemy

    env = make_env("postgres", "sqlalchemy-connection", tmp_path, postgres_base_url)
    try:
        own = _held(env)
        conn = env.connect()
        with own.fenced(WID, conn):  # proves the connection
            env.write(conn, "r", "1")
        raw = conn.connection.dbapi_connection
        assert isinstance(raw, psycopg.Connection)
        with _traced(raw, tmp_path) as sent, own.fenced(WID, conn):
            env.write(conn, "r", "2")
        assert _round_trips(sent) == 5, sent  # BEGIN, the read, the UPDATE, the check, COMMIT
        assert "BEGIN" in sent[0] and "FOR SHARE" in sent[1], sent
        with conn.begin():  # inside an open transaction: a savepoint, as before
            with own.fenced(WID, conn):
                env.write(conn, "inner", "1")
            conn.execute(sqlalchemy.text("SELECT 1"))
        _rolls_back_then_is_refused(env, own, conn, conn.in_transaction)
        conn.close()
        assert env.rows() == {"r": "2", "inner": "1"}
    finally:
        env.close()


def test_sqlalchemy_session_on_psycopg_runs_the_read_unprepared_in_its_transaction(
    postgres_base_url: str, tmp_path: Path
) -> None:
    """An ORM ``Session`` on psycopg 3 runs the read inside the session's transaction, on the
    driver connection, as a ``Connection`` does."""
    import sqlalchemy
    from sqlalchemy import orm

    env = make_env("postgres", "sqlalchemy-session", tmp_path, postgres_base_url)
    try:
        engine = sqlalchemy.create_engine(
            env.db_url.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=1
        )
        session = orm.Session(engine)
        own = _held(env)
        with own.fenced(WID, session):  # proves the pooled connection
            env.write(session, "r", "1")
        assert env.rows() == {"r": "1"}
        raw = session.connection().connection.dbapi_connection
        session.rollback()  # back to the pool: the next block checks out the same connection
        assert isinstance(raw, psycopg.Connection)
        with _traced(raw, tmp_path) as sent, own.fenced(WID, session):
            env.write(session, "r", "2")
        assert _round_trips(sent) == 5, sent  # BEGIN, the read, the UPDATE, the check, COMMIT
        assert "BEGIN" in sent[0] and "FOR SHARE" in sent[1], sent
        _rolls_back_then_is_refused(env, own, session, session.in_transaction)
        session.close()
        engine.dispose()
        assert env.rows() == {"r": "2"}
    finally:
        env.close()
