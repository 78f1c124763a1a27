"""Ownership.fenced on every accepted driver, on SQLite and PostgreSQL: commit, refusal, nesting."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fencing.hosts import HostEnv
from weft_sync import keys
from weft_sync.errors import (
    EngineDeposedError,
    StorageCapabilityError,
    WorkflowClaimLostWarning,
)
from weft_sync.fencing import core
from weft_sync.storage import open_storage


def test_fenced_block_commits_the_hosts_write(env: HostEnv) -> None:
    own = env.ownership()
    conn = env.connect()
    with own.claim("wf-1"), own.fenced("wf-1", conn) as yielded:
        assert yielded is conn
        env.write(yielded, "r1", "a")
        assert env.rows() == {}  # not committed before the block ends
    assert env.rows() == {"r1": "a"}


def test_exception_in_the_block_rolls_the_write_back(env: HostEnv) -> None:
    own = env.ownership()
    conn = env.connect()
    with own.claim("wf-1"):
        with pytest.raises(ZeroDivisionError), own.fenced("wf-1", conn) as yielded:
            env.write(yielded, "r1", "a")
            raise ZeroDivisionError
        with own.fenced("wf-1", conn) as yielded:  # the connection is usable again
            env.write(yielded, "r2", "b")
    assert env.rows() == {"r2": "b"}


def test_deposed_owner_is_refused_and_the_new_owner_lands(env: HostEnv) -> None:
    old = env.ownership()
    lost: list[str] = []
    old.on_lost(lost.append)
    assert old.registry.acquire("wf-1").status == "acquired"
    new = env.take_over("wf-1")
    stale, fresh = env.connect(), env.connect()
    ran = []
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError) as err,
        old.fenced("wf-1", stale) as yielded,
    ):
        ran.append(True)
        env.write(yielded, "r1", "stale")
    assert err.value.workflow_id == "wf-1"
    assert ran == [] and lost == ["wf-1"]
    with new.fenced("wf-1", fresh) as yielded:
        env.write(yielded, "r1", "fresh")
    assert env.rows() == {"r1": "fresh"}
    # The refused connection is left usable, outside any transaction.
    with new.fenced("wf-1", stale) as yielded:
        env.write(yielded, "r2", "ok")
    assert env.rows() == {"r1": "fresh", "r2": "ok"}


def test_unheld_claim_is_refused_before_any_statement(env: HostEnv) -> None:
    own = env.ownership()
    conn = env.connect()
    with (
        pytest.raises(EngineDeposedError),
        own.fenced("never-claimed", conn),
    ):
        pytest.fail("the block ran without a claim")
    assert env.rows() == {}


def test_nested_block_is_a_savepoint_that_checks_its_own_fence(env: HostEnv) -> None:
    own = env.ownership()
    conn = env.connect()
    assert own.registry.acquire("mine").status == "acquired"
    with own.fenced("mine", conn) as outer:
        env.write(outer, "outer", "1")
        with (
            pytest.raises(EngineDeposedError),
            own.fenced("not-mine", conn),
        ):
            pytest.fail("the inner block ran without a claim")
        with own.fenced("mine", conn) as inner:
            env.write(inner, "inner", "2")
        with pytest.raises(KeyError), own.fenced("mine", conn) as inner:
            env.write(inner, "rolled-back", "3")
            raise KeyError
    assert env.rows() == {"outer": "1", "inner": "2"}


def test_deposed_inside_a_hosts_open_transaction_keeps_its_earlier_work(raw_env: HostEnv) -> None:
    env = raw_env
    own = env.ownership()
    assert own.registry.acquire("wf-1").status == "acquired"
    env.take_over("wf-1")
    conn = env.connect()
    if env.backend == "sqlite":
        conn.execute("BEGIN")
    env.write(conn, "before", "host")  # psycopg begins its transaction implicitly
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        own.fenced("wf-1", conn) as yielded,
    ):
        env.write(yielded, "fenced", "x")
    conn.commit()
    assert env.rows() == {"before": "host"}


def test_other_sqlite_file_is_refused_naming_both(tmp_path: Path) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("sqlite", "sqlite3", tmp_path, None)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        other = sqlite3.connect(str(tmp_path / "other.db"))
        try:
            with pytest.raises(StorageCapabilityError) as err, own.fenced("wf-1", other):
                pytest.fail("fenced on another file")
        finally:
            other.close()
        message = str(err.value)
        assert "other.db" in message and "shared.db" in message
        assert err.value.capability == "same_database"
    finally:
        env.close()


def test_attached_store_file_is_accepted(tmp_path: Path) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("sqlite", "sqlite3", tmp_path, None)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = sqlite3.connect(str(tmp_path / "host-main.db"), isolation_level=None)
        try:
            conn.execute("ATTACH DATABASE ? AS weft", (env.db_url,))
            with own.fenced("wf-1", conn):
                conn.execute(f"INSERT INTO weft.{env.table} (id, v) VALUES ('a', 'b')")
        finally:
            conn.close()
        assert env.rows() == {"a": "b"}
    finally:
        env.close()


@pytest.mark.parametrize("isolation_level", [None, "", "DEFERRED", "IMMEDIATE"])
def test_sqlite_isolation_levels_all_fence(tmp_path: Path, isolation_level: str | None) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("sqlite", "sqlite3", tmp_path, None)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = sqlite3.connect(env.db_url, isolation_level=isolation_level)
        try:
            with own.fenced("wf-1", conn):
                assert conn.in_transaction
                env.write(conn, "a", "1")
            assert not conn.in_transaction
            env.write(conn, "b", "2")  # the host's own transaction (implicit unless None)
            nested = conn.in_transaction
            with own.fenced("wf-1", conn):  # a savepoint inside the host's transaction
                env.write(conn, "c", "3")
            assert conn.in_transaction == nested
            if nested:
                conn.rollback()  # the host's choice: the savepoint's work goes with it
        finally:
            conn.close()
        if isolation_level is None:
            assert env.rows() == {"a": "1", "b": "2", "c": "3"}
        else:
            assert env.rows() == {"a": "1"}
    finally:
        env.close()


def test_postgres_search_path_without_the_table_is_refused(
    postgres_base_url: str, tmp_path: Path
) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = env.connect()
        conn.execute("CREATE SCHEMA IF NOT EXISTS fence_elsewhere")
        conn.execute("SET search_path = fence_elsewhere")
        conn.commit()
        with pytest.raises(StorageCapabilityError) as err, own.fenced("wf-1", conn):
            pytest.fail("fenced where the table is not visible")
        assert "not visible" in str(err.value)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        env.close()


def test_postgres_other_database_is_refused_naming_both(
    postgres_base_url: str, tmp_path: Path
) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    name = "fence_other_" + env.table[-12:]
    admin = psycopg.connect(postgres_base_url, autocommit=True)
    try:
        admin.execute(f"CREATE DATABASE {name}")
        own = env.ownership()
        own.registry.acquire("wf-1")
        info = psycopg.conninfo.conninfo_to_dict(postgres_base_url)
        info["dbname"] = name
        other = psycopg.connect(psycopg.conninfo.make_conninfo(**info))
        try:
            with pytest.raises(StorageCapabilityError) as err, own.fenced("wf-1", other):
                pytest.fail("fenced on another database")
        finally:
            other.close()
        message = str(err.value)
        assert repr(name) in message and repr(info.get("dbname")) not in ("",)
        assert "PostgreSQL database" in message and message.count("PostgreSQL database") == 2
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.close()
        env.close()


def test_connection_of_the_other_family_is_refused(raw_env: HostEnv, tmp_path: Path) -> None:
    own = raw_env.ownership()
    own.registry.acquire("wf-1")
    if raw_env.backend == "sqlite":
        _family_refusal_sqlite_store(own)
        return
    conn = sqlite3.connect(str(tmp_path / "x.db"))
    try:
        with (
            pytest.raises(StorageCapabilityError, match="'sqlite' database"),
            own.fenced("wf-1", conn),
        ):
            pytest.fail("fenced across families")
    finally:
        conn.close()


def _family_refusal_sqlite_store(own: Any) -> None:
    class FakePostgres:
        family = "postgresql"
        connection_key = None
        result = None

        def begin(self) -> bool:
            raise AssertionError("began a transaction on the wrong family")

        def query(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
            raise AssertionError("queried the wrong family")

        def end(self, error: BaseException | None) -> None:
            raise AssertionError("ended the wrong family")

    with (
        pytest.raises(StorageCapabilityError, match="'postgresql' database"),
        own.fenced("wf-1", FakePostgres()),
    ):
        pytest.fail("fenced across families")


def test_unsupported_connection_type_is_a_type_error(raw_env: HostEnv) -> None:
    own = raw_env.ownership()
    with (
        pytest.raises(TypeError, match=r"builtins\.dict.*sqlite3\.Connection.*Session"),
        own.fenced("wf-1", {}),
    ):
        pytest.fail("fenced a dict")


def test_same_database_proof_is_cached_per_connection(raw_env: HostEnv) -> None:
    own = raw_env.ownership()
    own.registry.acquire("wf-1")
    conn = raw_env.connect()
    seen: list[str] = []
    target = own.storage.fence_target()  # type: ignore[attr-defined]
    original = type(target).bind

    def counting_bind(self: Any, query: Any) -> Any:
        seen.append("bind")
        return original(self, query)

    type(target).bind = counting_bind  # type: ignore[method-assign]
    try:
        for _ in range(3):
            with own.fenced("wf-1", conn):
                pass
    finally:
        type(target).bind = original  # type: ignore[method-assign]
    # A psycopg connection is proven once; a sqlite3 one (no weak references) is proven in full
    # once, then re-checked by every block (see tests/fencing/test_sqlite_proof.py).
    assert len(seen) == 1
    if raw_env.backend == "postgres":
        assert conn in core._PROOFS
    else:
        assert own._fence.hint is not None  # the guess each later block re-checks


def test_epoch_key_is_the_one_the_ledger_fences(raw_env: HostEnv) -> None:
    own = raw_env.ownership()
    own.registry.acquire("wf/ü 1")
    raw = own.storage.get(keys.workflow_owner_epoch("wf/ü 1"))
    assert raw == own.registry.current_epoch_bytes("wf/ü 1")
    conn = raw_env.connect()
    with own.fenced("wf/ü 1", conn):
        raw_env.write(conn, "x", "y")
    assert raw_env.rows() == {"x": "y"}


@pytest.mark.postgres_only
def test_postgres_other_cluster_is_refused_naming_both(
    postgres_base_url: str, tmp_path: Path, private_cluster: Any
) -> None:
    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        # Same database name, same table name: only the cluster differs.
        with psycopg.connect(private_cluster.url, autocommit=True) as setup:
            setup.execute(f"CREATE TABLE {store_table_of(env)} (key TEXT, value BYTEA)")
        other = psycopg.connect(private_cluster.url)
        try:
            with pytest.raises(StorageCapabilityError) as err, own.fenced("wf-1", other):
                pytest.fail("fenced on another cluster")
        finally:
            other.close()
        with psycopg.connect(env.db_url) as mine:
            row = mine.execute("SELECT system_identifier FROM pg_control_system()").fetchone()
        with psycopg.connect(private_cluster.url) as theirs:
            row2 = theirs.execute("SELECT system_identifier FROM pg_control_system()").fetchone()
        assert row is not None and row2 is not None
        assert str(row[0]) in str(err.value) and str(row2[0]) in str(err.value)
    finally:
        env.close()


def store_table_of(env: HostEnv) -> str:
    return env.storage_url.rsplit("table=", 1)[1]


def test_store_without_a_fence_target_is_refused(raw_env: HostEnv) -> None:
    from tests.reliability.faulty import FaultyStorage

    inner = open_storage(raw_env.storage_url)
    try:
        own = raw_env.ownership(storage=FaultyStorage(inner, rate=0.0))
        own.registry.acquire("wf-1")
        conn = raw_env.connect()
        with pytest.raises(StorageCapabilityError) as err, own.fenced("wf-1", conn):
            pytest.fail("fenced through a store that cannot describe its table")
        assert err.value.capability == "host_fence"
        assert "FaultyStorage" in str(err.value)
        own.close()
    finally:
        inner.close()


def test_fenced_after_close_is_a_closed_error(raw_env: HostEnv) -> None:
    from weft_sync.errors import ClosedError

    own = raw_env.ownership()
    own.close()
    with pytest.raises(ClosedError, match=r"fenced\(\)"):
        own.fenced("wf-1", raw_env.connect())


@pytest.mark.postgres_only
def test_repeatable_read_snapshot_older_than_a_takeover_fails_closed(
    postgres_base_url: str, tmp_path: Path
) -> None:
    from tests.fencing.hosts import make_env
    from weft_sync.errors import StorageError

    env = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = env.connect()
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        env.write(conn, "before", "snapshot taken")  # the transaction's snapshot starts here
        env.take_over("wf-1")
        with pytest.raises(StorageError, match="serialize"), own.fenced("wf-1", conn):
            pytest.fail("fenced on a stale snapshot")
        conn.rollback()
        assert env.rows() == {}
    finally:
        env.close()


@pytest.mark.postgres_only
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_autocommit_driver_connection_still_runs_one_transaction(
    postgres_base_url: str, tmp_path: Path, driver: str
) -> None:
    import psycopg2.extensions

    from tests.fencing.hosts import make_env

    env = make_env("postgres", driver, tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = env.connect()
        conn.autocommit = True
        with own.fenced("wf-1", conn):
            env.write(conn, "a", "1")
            if driver == "psycopg":
                assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            else:
                status = conn.get_transaction_status()
                assert status == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
            assert env.rows() == {}  # not committed statement by statement
        assert env.rows() == {"a": "1"}
        with pytest.raises(KeyError), own.fenced("wf-1", conn):
            env.write(conn, "b", "2")
            raise KeyError
        assert env.rows() == {"a": "1"}
    finally:
        env.close()


@pytest.mark.postgres_only
def test_psycopg_host_row_factory_does_not_change_the_epoch_read(
    postgres_base_url: str, tmp_path: Path
) -> None:
    from psycopg.rows import dict_row

    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = psycopg.connect(env.db_url, row_factory=dict_row)
        try:
            with own.fenced("wf-1", conn):
                env.write(conn, "a", "dict rows")
        finally:
            conn.close()
        assert env.rows() == {"a": "dict rows"}
    finally:
        env.close()


@pytest.mark.postgres_only
def test_psycopg2_host_cursor_factory_does_not_change_the_epoch_read(
    postgres_base_url: str, tmp_path: Path
) -> None:
    import psycopg2
    import psycopg2.extras

    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg2", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        conn = psycopg2.connect(env.db_url, cursor_factory=psycopg2.extras.RealDictCursor)
        try:
            with own.fenced("wf-1", conn):
                env.write(conn, "a", "dict rows")
        finally:
            conn.close()
        assert env.rows() == {"a": "dict rows"}
    finally:
        env.close()
