"""Behind pgbouncer in transaction mode: detected or declared, never silently unbounded.

A real pgbouncer (Debian's package) runs in front of the test cluster with
``ignore_startup_parameters = options``, so the ``-c statement_timeout=…`` weft sends is
dropped. Opened without ``pooler=transaction`` the store refuses to open, naming the bound that is
not in effect; declared, it runs with prepared statements off, no session locks (crash detection
by TTL, with a warning), and a client-side bound that a 20 s ``LOCK TABLE`` cannot outlast.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import in_ci
from tests.pgbouncer import pgbouncer_binary, transaction_pooler
from weft_sync.errors import StorageError
from weft_sync.storage import open_storage
from weft_sync.storage.postgres.store import PostgresStorage
from weft_sync.storage.session_locks import storage_session_locks

RENEW_MS = 2_000
BOUND_S = RENEW_MS / 1000 + 1.0
LOCK_HELD_S = 20.0

pytestmark = [pytest.mark.postgres_only, pytest.mark.slow]


@pytest.fixture
def pooler_url(postgres_base_url: str) -> Iterator[str]:
    if pgbouncer_binary() is None:
        if in_ci():
            pytest.fail("pgbouncer is not installed (apt-get install -y pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    with transaction_pooler(postgres_base_url) as url:
        yield url


@pytest.fixture
def table() -> str:
    return "t_" + uuid.uuid4().hex[:16]


def test_an_open_through_a_pooler_that_drops_the_bounds_fails_naming_them(
    pooler_url: str, table: str
) -> None:
    with pytest.raises(StorageError, match="statement_timeout is 0 ms, not 2000 ms") as raised:
        PostgresStorage(pooler_url, table=table, renew_interval_ms=RENEW_MS)
    assert "pooler=transaction" in str(raised.value)


def test_declared_transaction_pooling_runs_without_prepared_statement_errors(
    pooler_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="weft_sync.storage.postgres.store"):
        store = open_storage(
            f"{pooler_url}&table={table}&pooler=transaction", renew_interval_ms=RENEW_MS
        )
    try:
        assert "transaction-mode pooler" in caplog.text
        assert storage_session_locks(store) is None  # crash detection falls back to the TTL
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
