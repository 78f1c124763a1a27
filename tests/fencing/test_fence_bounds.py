"""Bounded waits around a long-open fenced transaction: renewals, takeovers, stalled hosts."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from tests.fencing.hosts import PAST_EXPIRY_MS, HostEnv
from tests.fencing.race import TakeoverAttempt, store_table, wait_until_blocked
from weft_sync import OwnershipOptions, keys
from weft_sync.errors import StorageError
from weft_sync.storage import open_storage


def _with_param(url: str, name: str, value: object) -> str:
    return f"{url}{'&' if '?' in url else '?'}{name}={value}"


def test_open_fenced_transaction_costs_no_claim(raw_env: HostEnv) -> None:
    """While a fenced block is open, this engine's other claims survive (renewed or retried)."""
    env = raw_env
    url = env.storage_url
    if env.backend == "sqlite":
        url = _with_param(url, "busy_timeout_ms", 100)  # a renewal gives up quickly
    own = env.ownership(storage=url)
    ids = ["held-0", "held-1", "held-2"]
    for wid in ids:
        assert own.registry.acquire(wid).status == "acquired"
    conn = env.connect()
    with own.fenced("held-0", conn):
        env.write(conn, "r", "open")
        env.clock.advance(1000)
        during = own.run_maintenance()
    if env.backend == "postgres":
        # The fence locks the epoch row only; renewals update holder rows: nothing waited.
        assert during.renewed_count == len(ids) and during.failed_count == 0
    else:
        # SQLite's write lock is the file's: the renewal waited, gave up, and kept its claims.
        assert during.failed_count == len(ids)
    assert sorted(own.registry.list_held_workflow_ids()) == ids
    env.clock.advance(1000)
    after = own.run_maintenance()
    assert after.renewed_count == len(ids) and after.failed_count == 0
    assert env.rows() == {"r": "open"}


def test_takeover_gives_up_waiting_and_succeeds_later(raw_env: HostEnv) -> None:
    """A takeover blocked by a fenced transaction fails after the store's bound, then retries."""
    env = raw_env
    owner = env.ownership()
    bound = ("busy_timeout_ms", 150) if env.backend == "sqlite" else ("lock_timeout", 0.15)
    rival_store = open_storage(_with_param(env.storage_url, *bound))
    try:
        rival = env.ownership(storage=rival_store)
        assert owner.registry.acquire("wf-1").status == "acquired"
        env.clock.advance(PAST_EXPIRY_MS)
        conn = env.connect()
        with owner.fenced("wf-1", conn):
            env.write(conn, "wf-1", "A")
            attempt = TakeoverAttempt.start(rival, "wf-1")
            attempt.thread.join(30)
            assert attempt.status == "storage-error"
        assert env.rows() == {"wf-1": "A"}
        assert rival.registry.takeover("wf-1").status == "acquired"
    finally:
        rival.close()
        rival_store.close()


@pytest.mark.postgres_only
def test_stalled_fenced_transaction_is_ended_by_the_server(
    postgres_base_url: str, tmp_path: object
) -> None:
    """A host stalled inside the block past the claim TTL loses its transaction, not the race."""
    from pathlib import Path

    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", Path(str(tmp_path)), postgres_base_url)
    try:
        options = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)
        # The rival's lock wait (by default bounded by the renew interval) outlasts the stall.
        rival_url = _with_param(
            _with_param(env.storage_url, "lock_timeout", 10), "statement_timeout", 10
        )
        owner = env.ownership(options=options)
        rival = env.ownership(options=options, storage=rival_url)
        assert owner.registry.acquire("wf-1").status == "acquired"
        env.clock.advance(600 + 2 * 200 + 1)
        conn = env.connect()
        with pytest.raises(psycopg.Error, match="idle-in-transaction"), owner.fenced("wf-1", conn):
            env.write(conn, "wf-1", "A")
            attempt = TakeoverAttempt.start(rival, "wf-1")
            wait_until_blocked(env, attempt, store_table(env))
            assert not attempt.done()
            # The host stalls (a stopped process, a forgotten transaction) past the claim TTL:
            # idle_in_transaction_session_timeout ends its session and releases the row lock.
            attempt.thread.join(30)
            assert attempt.status == "acquired"
        assert env.rows() == {}
        epoch = rival.storage.get(keys.workflow_owner_epoch("wf-1"))
        assert epoch == rival.registry.current_epoch_bytes("wf-1")
    finally:
        env.close()


@pytest.mark.postgres_only
def test_fence_lock_wait_is_bounded(postgres_base_url: str, tmp_path: object) -> None:
    """A fence that cannot lock the epoch row within the renew interval raises StorageError."""
    from pathlib import Path

    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", Path(str(tmp_path)), postgres_base_url)
    try:
        options = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)
        owner = env.ownership(options=options)
        assert owner.registry.acquire("wf-1").status == "acquired"
        blocker = psycopg.connect(env.db_url)
        blocker.execute(
            f"SELECT value FROM {store_table(env)} WHERE key = %s FOR UPDATE",
            [keys.workflow_owner_epoch("wf-1")],
        )
        conn = env.connect()
        try:
            with pytest.raises(StorageError, match="lock timeout"), owner.fenced("wf-1", conn):
                pytest.fail("the fence went ahead without its lock")
        finally:
            blocker.rollback()
            blocker.close()
        with owner.fenced("wf-1", conn):
            env.write(conn, "after", "ok")
        assert env.rows() == {"after": "ok"}
    finally:
        env.close()


def test_repeated_fenced_transactions_do_not_starve_renewals(raw_env: HostEnv) -> None:
    """A host running fenced blocks back to back still lets every renewal through."""
    env = raw_env
    own = env.ownership()
    for wid in ("busy", "other-0", "other-1"):
        assert own.registry.acquire(wid).status == "acquired"
    stop = threading.Event()
    blocks = [0]
    errors: list[BaseException] = []

    def hammer() -> None:
        conn = env.connect()
        try:
            while not stop.is_set():
                with own.fenced("busy", conn):
                    env.write(conn, "busy", str(blocks[0]))
                blocks[0] += 1
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=hammer, name="fence-hammer")
    worker.start()
    try:
        passes = []
        for _ in range(5):
            env.clock.advance(1000)
            passes.append(own.run_maintenance())
            time.sleep(0.01)
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert blocks[0] > 0
    assert all(p.failed_count == 0 and p.renewed_count == 3 for p in passes)


def test_ledger_write_inside_a_fenced_block_fails_instead_of_hanging(raw_env: HostEnv) -> None:
    """A write through the store for the same workflow waits for the block's lock, boundedly."""
    env = raw_env
    if env.backend == "sqlite":
        store = open_storage(_with_param(env.storage_url, "busy_timeout_ms", 150))
    else:
        from weft_sync.storage.postgres.store import PostgresStorage

        store = PostgresStorage(env.db_url, table=store_table(env), lock_timeout=0.15)
    try:
        own = env.ownership(storage=store)
        assert own.registry.acquire("wf-1").status == "acquired"
        conn = env.connect()
        with own.fenced("wf-1", conn):
            env.write(conn, "r", "host")
            with pytest.raises(StorageError):
                own.workflows.save_checkpoint("wf-1", b"inside")
        own.workflows.save_checkpoint("wf-1", b"after")
        assert own.workflows.load_checkpoint("wf-1") == b"after"
        assert env.rows() == {"r": "host"}
    finally:
        own.close()
        store.close()


def test_bad_lock_timeout_in_a_url_names_the_value(postgres_base_url: str) -> None:
    with pytest.raises(ValueError, match=r"lock_timeout='soon'.*seconds"):
        open_storage(_with_param(postgres_base_url, "lock_timeout", "soon"))
    with pytest.raises(ValueError, match=r"lock_timeout must be a positive number.*-1"):
        open_storage(_with_param(postgres_base_url, "lock_timeout", "-1"))


@pytest.mark.postgres_only
def test_takeover_waiting_on_the_fence_blocks_no_renewal(
    postgres_base_url: str, tmp_path: object
) -> None:
    """A batched takeover stuck on a fenced epoch row holds no holder row: renewals go on."""
    from pathlib import Path

    from tests.fencing.hosts import make_env

    env = make_env("postgres", "psycopg", Path(str(tmp_path)), postgres_base_url)
    try:
        owner, rival = env.ownership(), env.ownership()
        ids = ["wf-0", "wf-1", "wf-2"]
        for wid in ids:
            assert owner.registry.acquire(wid).status == "acquired"
        env.clock.advance(PAST_EXPIRY_MS)  # every claim looks dead to the rival
        conn = env.connect()
        results: list[object] = []
        with owner.fenced("wf-1", conn):
            env.write(conn, "wf-1", "A")
            batch = threading.Thread(
                target=lambda: results.extend(rival.registry.takeover_many(ids)), daemon=True
            )
            batch.start()
            attempt = TakeoverAttempt(batch)
            wait_until_blocked(env, attempt, store_table(env))
            assert not attempt.done()
            # The owner renews every claim while the rival's batch waits on wf-1's epoch row.
            renewed = owner.registry.renew_many(ids)
            assert [r.status for r in renewed] == ["renewed"] * 3
        batch.join(30)
        assert [getattr(r, "status", None) for r in results] == ["lost-race"] * 3
        assert sorted(owner.registry.list_held_workflow_ids()) == ids
        assert env.rows() == {"wf-1": "A"}
    finally:
        env.close()
