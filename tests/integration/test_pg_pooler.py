"""Behind pgbouncer in transaction mode: found or declared, bounded by the server per transaction.

A real pgbouncer (Debian's package) runs in front of the test cluster with
``ignore_startup_parameters = options``, so the ``-c statement_timeout=…`` weft sends at connect
is dropped. Opened with ``pooler=none`` the store refuses to open, naming the bound that is not in
effect; opened as it is, it finds the pooler itself (one warning), and declared or found it runs
with prepared statements off, no session locks (crash detection by TTL) and every transaction
opened with ``SET LOCAL`` of its bounds, so the server itself cuts a statement a foreign
``LOCK TABLE`` holds up, at the bound, before the client-side deadline would.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from tests.claims.gated import new_registry
from tests.conftest import in_ci
from tests.pgbouncer import pgbouncer_binary, transaction_pooler
from weft_sync.clock import ManualClock
from weft_sync.errors import StorageError
from weft_sync.storage import open_storage
from weft_sync.storage.base import Condition, Put
from weft_sync.storage.postgres.store import PostgresStorage
from weft_sync.storage.session_locks import storage_session_locks

RENEW_MS = 2_000
BOUND_S = RENEW_MS / 1000 + 1.0
LOCK_HELD_S = 20.0
LOCK_TIMEOUT_S = 0.2
STATEMENT_TIMEOUT_S = 0.3
MARGIN_S = 0.2
"""How far past the server's bound a cut call may return: well inside the client's 0.25 s."""
STORE_LOGGER = "weft_sync.storage.postgres.store"

pytestmark = [pytest.mark.postgres_only, pytest.mark.slow]


@pytest.fixture(scope="module")
def pooler_url(postgres_base_url: str) -> Iterator[str]:
    if pgbouncer_binary() is None:
        if in_ci():
            pytest.fail("pgbouncer is not installed (apt-get install -y pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    with transaction_pooler(postgres_base_url) as url:
        yield url


@pytest.fixture
def table(postgres_base_url: str) -> Iterator[str]:
    name = "t_" + uuid.uuid4().hex[:16]
    yield name
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == STORE_LOGGER and r.levelno >= logging.WARNING]


def _show(conn: psycopg.Connection[tuple[object, ...]], setting: str) -> str:
    row = conn.execute(f"SHOW {setting}").fetchone()
    assert row is not None
    return str(row[0])


# -- found or declared -----------------------------------------------------------------------


@pytest.mark.parametrize("pooler", ["none", "session"])
def test_an_open_through_a_pooler_with_pooler_none_fails_naming_the_bound_not_in_effect(
    pooler_url: str, table: str, pooler: str
) -> None:
    with pytest.raises(StorageError, match="statement_timeout is 0 ms, not 2000 ms") as raised:
        PostgresStorage(pooler_url, table=table, renew_interval_ms=RENEW_MS, pooler=pooler)
    assert "pooler=transaction" in str(raised.value)


def test_an_open_through_pgbouncer_finds_the_pooler_and_warns_once_with_the_url_redacted(
    pooler_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    # pgbouncer trusts this user, so the password is never asked for: it is there to be hidden.
    url = pooler_url.replace("postgres@", "postgres:s3cret-pw@", 1)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = open_storage(f"{url}&table={table}", renew_interval_ms=RENEW_MS)
    try:
        (record,) = _warnings(caplog)
        message = record.getMessage()
        assert "found at open" in message and "pg_backend_pid()" in message
        assert table in message and "postgres:***@" in message
        assert "s3cret-pw" not in caplog.text
        for change in ("claim TTL", "prepared statements are off", "SET LOCAL"):
            assert change in message
        assert storage_session_locks(store) is None  # crash detection falls back to the TTL
        assert store.capabilities.session_locks is False
        store.put("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_a_read_only_open_through_the_pooler_fails_saying_why(
    pooler_url: str, postgres_base_url: str, table: str
) -> None:
    PostgresStorage(postgres_base_url, table=table).close()  # the table exists
    with pytest.raises(StorageError, match="read-only session cannot be kept") as raised:
        PostgresStorage(pooler_url, table=table, read_only=True)
    assert "pg_backend_pid()" in str(raised.value)


@pytest.mark.parametrize("pooler", ["transaction", "auto"])
def test_transaction_pooling_runs_without_prepared_statement_errors(
    pooler_url: str, table: str, caplog: pytest.LogCaptureFixture, pooler: str
) -> None:
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = open_storage(
            f"{pooler_url}&table={table}&pooler={pooler}", renew_interval_ms=RENEW_MS
        )
    try:
        assert len(_warnings(caplog)) == 1
        assert "transaction-mode pooler" in caplog.text
        assert storage_session_locks(store) is None
        # Far past psycopg's automatic prepare threshold (5), from several threads, so that
        # statements land on different server sessions.
        errors: list[BaseException] = []

        def work(n: int) -> None:
            try:
                for i in range(40):
                    store.put(f"k-{n}-{i}", b"v")
                    assert store.get(f"k-{n}-{i}") == b"v"
            except BaseException as exc:  # collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == []
        assert len(store.scan("k-")) == 160
    finally:
        store.close()


# -- server-side bounds, per transaction -----------------------------------------------------


def test_a_store_transaction_behind_the_pooler_runs_with_the_configured_bounds(
    pooler_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{pooler_url}&table={table}&statement_timeout=1.5&lock_timeout=250ms"
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = open_storage(url, renew_interval_ms=RENEW_MS)
    assert isinstance(store, PostgresStorage)
    try:
        with store._write_transaction("show") as conn:
            assert _show(conn, "statement_timeout") == "1500ms"
            assert _show(conn, "lock_timeout") == "250ms"
            assert _show(conn, "idle_in_transaction_session_timeout") == "4s"
        assert store._read("show", "SHOW statement_timeout", []) == [("1500ms",)]
        # Nothing is left on the server session the pooler lends to the next client.
        with store._connection("show") as conn:
            assert _show(conn, "statement_timeout") == "0"
    finally:
        store.close()


def _blocked_calls(store: PostgresStorage) -> dict[str, Callable[[], object]]:
    """One call of each kind of transaction the store runs, on the key ``k``."""
    return {
        "get": lambda: store.get("k"),
        "scan": lambda: store.scan("k"),
        "put": lambda: store.put("k", b"w"),
        "conditional_batch": lambda: store.conditional_batch(
            [Condition("k", b"v")], [Put("k", b"w")]
        ),
        "read_then_write": lambda: store.read_then_write(
            ["k"], lambda found: ([Condition("k", found[0])], [Put("k", b"w")])
        ),
        "compare_and_set_many": lambda: store.compare_and_set_many([("k", b"v", b"w")]),
        "conditional_batches": lambda: store.conditional_batches(
            [([Condition("k", b"v")], [Put("k", b"w")]), ([Condition("j", None)], [])]
        ),
    }


def _cut_while_locked(
    store: PostgresStorage, postgres_base_url: str, table: str, call: Callable[[], object]
) -> tuple[StorageError, float]:
    """Run ``call`` while a direct session holds ``table`` in ACCESS EXCLUSIVE mode."""
    with psycopg.connect(postgres_base_url) as holder:
        holder.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
        start = time.monotonic()
        with pytest.raises(StorageError) as raised:
            call()
        blocked = time.monotonic() - start
        holder.rollback()
    return raised.value, blocked


@pytest.mark.parametrize(
    "kind",
    [
        "get",
        "scan",
        "put",
        "conditional_batch",
        "read_then_write",
        "compare_and_set_many",
        "conditional_batches",
    ],
)
def test_behind_the_pooler_a_call_held_up_by_a_table_lock_is_cut_by_the_servers_lock_timeout(
    pooler_url: str, postgres_base_url: str, table: str, kind: str
) -> None:
    store = PostgresStorage(
        pooler_url, table=table, lock_timeout=LOCK_TIMEOUT_S, statement_timeout=2.0
    )
    try:
        store.put("k", b"v")
        error, blocked = _cut_while_locked(
            store, postgres_base_url, table, _blocked_calls(store)[kind]
        )
        cause = error.__cause__
        assert isinstance(cause, psycopg.errors.LockNotAvailable), repr(cause)  # 55P03
        assert cause.sqlstate == "55P03"
        assert blocked < LOCK_TIMEOUT_S + MARGIN_S, f"{kind} blocked {blocked:.2f} s"
        assert store.get("k") == b"v"
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["get", "put", "read_then_write", "conditional_batches"])
def test_behind_the_pooler_a_statement_held_up_by_a_table_lock_is_cut_by_statement_timeout(
    pooler_url: str, postgres_base_url: str, table: str, kind: str
) -> None:
    store = PostgresStorage(
        pooler_url, table=table, lock_timeout=None, statement_timeout=STATEMENT_TIMEOUT_S
    )
    try:
        store.put("k", b"v")
        error, blocked = _cut_while_locked(
            store, postgres_base_url, table, _blocked_calls(store)[kind]
        )
        cause = error.__cause__
        assert isinstance(cause, psycopg.errors.QueryCanceled), repr(cause)  # 57014
        # The server's own cut, not the client's cancel (that one says "user request").
        assert cause.diag.message_primary == "canceling statement due to statement timeout"
        assert blocked < STATEMENT_TIMEOUT_S + MARGIN_S, f"{kind} blocked {blocked:.2f} s"
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_a_table_lock_held_for_20_s_blocks_no_call_past_its_bound_behind_the_pooler(
    pooler_url: str, postgres_base_url: str, table: str
) -> None:
    store = open_storage(
        f"{pooler_url}&table={table}&pooler=transaction", renew_interval_ms=RENEW_MS
    )
    try:
        store.put("k", b"v")
        with psycopg.connect(postgres_base_url) as holder:
            holder.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            start = time.monotonic()
            with pytest.raises(StorageError):
                store.put("k", b"w")
            blocked = time.monotonic() - start
            holder.rollback()
        assert blocked <= BOUND_S, f"a write behind the pooler blocked {blocked:.2f} s"
        assert blocked < LOCK_HELD_S
        assert store.get("k") == b"v"
    finally:
        store.close()


# -- what a cycle costs -------------------------------------------------------------------------


def _round_trips(store: PostgresStorage, run: Callable[[], object]) -> tuple[int, str]:
    """Run ``run`` with libpq tracing every connection the store's pool lends; return the
    round trips (one ReadyForQuery ends each) and the trace."""
    pool = store._pool
    assert pool is not None
    fd, path = tempfile.mkstemp(prefix="weft-pq-trace-")
    getconn, putconn = pool.getconn, pool.putconn

    def traced_getconn(timeout: float | None = None) -> psycopg.Connection[tuple[object, ...]]:
        conn = getconn(timeout=timeout)
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        return conn

    def untraced_putconn(conn: psycopg.Connection[tuple[object, ...]]) -> None:
        conn.pgconn.untrace()
        putconn(conn)

    pool.getconn, pool.putconn = traced_getconn, untraced_putconn  # type: ignore[method-assign]
    try:
        run()
    finally:
        pool.getconn, pool.putconn = getconn, putconn  # type: ignore[method-assign]
        os.close(fd)
    with open(path) as trace_file:
        trace = trace_file.read()
    os.unlink(path)
    return sum("\tReadyForQuery\t" in line for line in trace.splitlines()), trace


def _cycle_round_trips(url: str) -> tuple[int, str]:
    """The round trips of one acquire + release cycle on the store at ``url``, and the trace."""
    with open_storage(url, renew_interval_ms=RENEW_MS) as store:
        assert isinstance(store, PostgresStorage)
        registry = new_registry(store, ManualClock(1_000_000))
        registry.acquire("warm-up")
        registry.release("warm-up")

        def cycle() -> None:
            assert registry.acquire("wf").status == "acquired"
            assert registry.release("wf").status == "released"

        try:
            return _round_trips(store, cycle)
        finally:
            registry.close()


def test_an_acquire_and_release_cycle_behind_the_pooler_takes_the_round_trips_of_a_direct_one(
    pooler_url: str, postgres_base_url: str, table: str
) -> None:
    sep = "&" if "?" in postgres_base_url else "?"
    direct, _ = _cycle_round_trips(f"{postgres_base_url}{sep}table={table}")
    pooled, trace = _cycle_round_trips(f"{pooler_url}&table={table}")
    assert (direct, pooled) == (8, 8)
    # Both transactions begin with their bounds, in the BEGIN's own round trip.
    assert trace.count("BEGIN; SET LOCAL statement_timeout = 2000; ") == 2
