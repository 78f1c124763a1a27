"""Isolated batches: a row another session holds locked fails alone, the rest commit at once."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from weft_sync.storage import Condition, Put, Storage
from weft_sync.storage.isolation import (
    RowLockedError,
    storage_compare_and_set_many_isolated,
    storage_conditional_batches_isolated,
)
from weft_sync.storage.postgres.store import PostgresStorage


@pytest.fixture
def pg_store(postgres_base_url: str) -> Iterator[PostgresStorage]:
    table = "t_" + uuid.uuid4().hex[:16]
    # A short lock timeout keeps the wait for the locked row small.
    store = PostgresStorage(postgres_base_url, table=table, renew_interval_ms=400)
    try:
        yield store
    finally:
        store.close()
        with psycopg.connect(postgres_base_url, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')


@contextmanager
def _row_locked(url: str, table: str, key: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """Hold ``key``'s row locked from another session (``SELECT … FOR UPDATE`` left open)."""
    with psycopg.connect(url) as foreign:
        row = foreign.execute(
            f'SELECT key FROM "{table}" WHERE key = %s FOR UPDATE', [key]
        ).fetchone()
        assert row is not None
        yield foreign
        foreign.rollback()


def _fill(store: Storage, n: int) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    store.batch([Put(k, b"v0") for k in keys])
    return keys


def test_a_locked_row_fails_alone_and_the_others_commit(
    pg_store: PostgresStorage, postgres_base_url: str
) -> None:
    keys = _fill(pg_store, 5)
    with _row_locked(postgres_base_url, pg_store._table, "k2"):
        results = storage_compare_and_set_many_isolated(pg_store, [(k, b"v0", b"v1") for k in keys])
        assert [r is True for r in results] == [True, True, False, True, True]
        locked = results[2]
        assert isinstance(locked, RowLockedError) and locked.key == "k2"
        assert locked.__cause__ is not None  # the lock wait that gave up first
    assert pg_store.get_many(keys) == [b"v1", b"v1", b"v0", b"v1", b"v1"]
    # Once the lock is gone the same row commits.
    assert storage_compare_and_set_many_isolated(pg_store, [("k2", b"v0", b"v1")]) == [True]


def test_failed_comparisons_and_absent_keys_stay_false_not_locked(
    pg_store: PostgresStorage, postgres_base_url: str
) -> None:
    _fill(pg_store, 3)
    with _row_locked(postgres_base_url, pg_store._table, "k0"):
        results = storage_compare_and_set_many_isolated(
            pg_store, [("k0", b"v0", b"v1"), ("k1", b"other", b"v1"), ("absent", b"v0", b"v1")]
        )
    assert isinstance(results[0], RowLockedError)
    assert results[1:] == [False, False]
    assert pg_store.get_many(["k0", "k1", "absent"]) == [b"v0", b"v0", None]


def test_a_row_locked_for_a_moment_gets_its_real_result(
    pg_store: PostgresStorage, postgres_base_url: str
) -> None:
    pg_store.close()
    store = PostgresStorage(postgres_base_url, table=pg_store._table, lock_timeout=20)
    try:
        keys = _fill(store, 3)
        locked = threading.Event()
        waited_for = threading.Event()

        def hold() -> None:
            # Lets go once the store's retry is waiting for this lock.
            with _row_locked(postgres_base_url, store._table, "k1") as foreign:
                pid = foreign.info.backend_pid
                locked.set()
                with psycopg.connect(postgres_base_url, autocommit=True) as probe:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        row = probe.execute(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE %s = ANY(pg_blocking_pids(pid))",
                            [pid],
                        ).fetchone()
                        if row is not None and row[0]:
                            waited_for.set()
                            break
                        time.sleep(0.01)

        holder = threading.Thread(target=hold, name="row-lock-holder")
        holder.start()
        try:
            assert locked.wait(20)
            results = storage_compare_and_set_many_isolated(
                store, [(k, b"v0", b"v1") for k in keys]
            )
        finally:
            holder.join(30)
        assert waited_for.is_set()
        assert results == [True, True, True]
    finally:
        store.close()


def test_disjoint_batches_on_a_locked_row_fail_alone(
    pg_store: PostgresStorage, postgres_base_url: str
) -> None:
    # Takeover-shaped: each batch compares and rewrites two keys of its own.
    pg_store.batch([Put(f"{p}{i}", b"old") for i in range(3) for p in ("h", "e")])
    batches = [
        (
            [Condition(f"h{i}", b"old"), Condition(f"e{i}", b"old")],
            [Put(f"h{i}", b"new"), Put(f"e{i}", b"new")],
        )
        for i in range(3)
    ]
    with _row_locked(postgres_base_url, pg_store._table, "e1"):
        results = storage_conditional_batches_isolated(pg_store, batches)
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], RowLockedError) and results[1].key == "e1"
    assert pg_store.get_many(["h0", "e1", "h1", "h2"]) == [b"new", b"old", b"old", b"new"]


def test_stores_without_row_locks_give_plain_results(storage: Storage) -> None:
    storage.batch([Put("a", b"1"), Put("b", b"1")])
    assert storage_compare_and_set_many_isolated(
        storage, [("a", b"1", b"2"), ("b", b"x", b"2")]
    ) == [True, False]
    assert storage_conditional_batches_isolated(
        storage, [([Condition("a", b"2")], [Put("a", b"3")])]
    ) == [True]
