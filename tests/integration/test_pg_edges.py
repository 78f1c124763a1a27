"""PostgreSQL under attack from another session: a locked row, a locked table, killed backends.

Each fault is real: a second psycopg session holds ``SELECT … FOR UPDATE`` or ``LOCK TABLE`` open,
or calls ``pg_terminate_backend`` on the engine's pooled sessions.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from tests.engines import adopt_claims
from weft_sync import ManualClock, Ownership, OwnershipOptions
from weft_sync.claims import ClaimRegistry
from weft_sync.errors import StorageError
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage.isolation import RowLockedError
from weft_sync.storage.postgres.store import PostgresStorage

TTL_MS = 3000
RENEW_MS = 1000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


@pytest.fixture
def table(postgres_base_url: str) -> Iterator[str]:
    name = "t_" + uuid.uuid4().hex[:16]
    yield name
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


def _url(base: str, query: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}{query}"


@contextmanager
def _row_locked(url: str, table: str, key: str) -> Iterator[None]:
    with psycopg.connect(url) as foreign:
        row = foreign.execute(
            f'SELECT key FROM "{table}" WHERE key = %s FOR UPDATE', [key]
        ).fetchone()
        assert row is not None
        yield
        foreign.rollback()


def _registry(store: PostgresStorage, engine: str, clock: ManualClock) -> ClaimRegistry:
    return ClaimRegistry(
        store,
        engine_id=engine,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=lambda w: pytest.fail(f"no claim may be lost here: {w}"),
    )


def test_a_locked_holder_row_fails_only_its_own_renewal(postgres_base_url: str, table: str) -> None:
    clock = ManualClock(1_000_000)
    with PostgresStorage(postgres_base_url, table=table, renew_interval_ms=400) as store:
        victim = _registry(store, "victim", clock)
        ids = [f"wf-{i}" for i in range(10)]
        for wid in ids:
            assert victim.acquire(wid).status == "acquired"
        clock.advance(RENEW_MS)
        with _row_locked(postgres_base_url, table, workflow_owner_holder("wf-3")):
            outcomes = victim.renew_many_outcomes(ids)
        assert isinstance(outcomes[3], RowLockedError)
        assert all(
            not isinstance(o, Exception) and o.status == "renewed"
            for i, o in enumerate(outcomes)
            if i != 3
        )
        # Not lost: still held, and renewed on the next pass once the lock is gone.
        assert "wf-3" in victim.list_held_workflow_ids()
        clock.advance(RENEW_MS)
        again = victim.renew_many_outcomes(ids)
        assert [getattr(o, "status", o) for o in again] == ["renewed"] * len(ids)


def test_a_locked_row_fails_only_its_own_takeover(postgres_base_url: str, table: str) -> None:
    clock = ManualClock(1_000_000)
    with PostgresStorage(postgres_base_url, table=table, renew_interval_ms=400) as store:
        dead = _registry(store, "dead", clock)
        ids = [f"wf-{i}" for i in range(6)]
        for wid in ids:
            assert dead.acquire(wid).status == "acquired"
        clock.advance(10 * TTL_MS)
        observer = _registry(store, "observer", clock)
        with _row_locked(postgres_base_url, table, workflow_owner_holder("wf-2")):
            outcomes = observer.takeover_many(ids)
        assert isinstance(outcomes[2], RowLockedError)
        statuses = [getattr(o, "status", None) for i, o in enumerate(outcomes) if i != 2]
        assert statuses == ["acquired"] * (len(ids) - 1)
        assert observer.takeover_many(["wf-2"])[0].status == "acquired"  # type: ignore[union-attr]


def test_an_engine_under_a_row_lock_attack_keeps_every_other_claim(
    postgres_base_url: str, table: str
) -> None:
    lost: list[str] = []
    url = _url(postgres_base_url, f"table={table}")
    with Ownership.open(
        url, options=OPTIONS, background="manual", warn=lambda w: lost.append(str(w))
    ) as victim:
        for i in range(20):
            victim.workflows.start(f"wf-{i}", "report")
        # Driven by this thread: a slow pass (a loaded machine) must not release them as claims
        # nobody drove; this test is about renewal under a row lock.
        adopt_claims(victim)
        with _row_locked(postgres_base_url, table, workflow_owner_holder("wf-7")):
            result = victim.run_maintenance()
        assert (result.renewed_count, result.failed_count) == (19, 1)
        (failed,) = [o for o in result.outcomes if o.status == "failed"]
        assert failed.workflow_id == "wf-7"
        assert isinstance(failed.error, RowLockedError)
        assert victim.metrics.snapshot().renewal_failures == 1
        assert lost == []
        after = victim.run_maintenance()
        assert (after.renewed_count, after.failed_count) == (20, 0)


def test_close_returns_within_its_bound_while_another_session_locks_the_table(
    postgres_base_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url(postgres_base_url, f"table={table}")
    victim = Ownership.open(url, options=OPTIONS, background="thread")
    try:
        for i in range(3):
            victim.workflows.start(f"wf-{i}", "report")
        with psycopg.connect(postgres_base_url) as foreign:
            foreign.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            with pytest.raises(StorageError, match="lock timeout"):
                victim.workflows.save_checkpoint("wf-0", b"blocked")
            with caplog.at_level(logging.WARNING, logger="weft_sync"):
                victim.close(timeout=2)
            assert victim.closed
            foreign.rollback()
    finally:
        victim.close()
    # What close reported: the claims it could not release under the lock.
    assert any("could not release" in r.getMessage() for r in caplog.records)


CLOSE_TIMEOUT_S = 2.0
CLOSE_GRACE_S = 0.5
"""What a bounded close may take past its timeout: a call begun at the deadline, its cancel."""


def test_close_ends_by_its_deadline_with_the_default_lock_bounds_under_a_table_lock(
    postgres_base_url: str, table: str
) -> None:
    # The default timing (renew every 5 s) gives each statement a lock timeout of its own that
    # several steps of close (the watcher's stop, the releases, the final liveness write) would
    # each wait out in turn: the store's calls end by the close's deadline instead.
    url = _url(postgres_base_url, f"table={table}")
    victim = Ownership.open(url, background="thread")
    try:
        for i in range(5):
            victim.workflows.start(f"wf-{i}", "report")
        adopt_claims(victim)
        with psycopg.connect(postgres_base_url) as foreign:
            foreign.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            # The engine's own threads meet the lock too (the watcher's scan, the renewal).
            with pytest.raises(StorageError, match="lock timeout"):
                victim.workflows.save_checkpoint("wf-0", b"blocked")
            began = time.monotonic()
            victim.close(timeout=CLOSE_TIMEOUT_S)
            took = time.monotonic() - began
            foreign.rollback()
        assert victim.closed
    finally:
        victim.close()
    assert took <= CLOSE_TIMEOUT_S + CLOSE_GRACE_S, f"close(timeout=2) took {took:.2f} s"


def _terminate(url: str, application_name: str) -> int:
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
            [f"{application_name} %"],
        ).fetchall()
    return len(rows)


def test_renewals_succeed_on_the_first_pass_after_a_kill_storm(
    postgres_base_url: str, table: str
) -> None:
    name = f"weft-storm-{uuid.uuid4().hex[:8]}"
    url = _url(postgres_base_url, f"table={table}&application_name={name}&min_size=4")
    clock = ManualClock(1_000_000)
    with Ownership.open(url, options=OPTIONS, background="manual", clock=clock) as victim:
        for i in range(10):
            victim.workflows.start(f"wf-{i}", "report")
        adopt_claims(victim)  # this thread drives them: the claims stay held
        stop = threading.Event()
        killed = [0]

        def storm() -> None:
            # A short storm: every 0.2 s for about 3 s, from a session of its own.
            for _ in range(15):
                if stop.is_set():
                    return
                killed[0] += _terminate(postgres_base_url, name)
                stop.wait(0.2)

        attacker = threading.Thread(target=storm, name="kill-storm")
        attacker.start()
        try:
            while attacker.is_alive():
                clock.advance(RENEW_MS)
                victim.run_maintenance()  # may fail while sessions are being killed
        finally:
            stop.set()
            attacker.join(30)
        assert killed[0] > 0
        clock.advance(RENEW_MS)
        first = victim.run_maintenance()
        assert (first.renewed_count, first.failed_count) == (10, 0)
        victim.workflows.save_checkpoint("wf-0", b"after-the-storm")
        assert victim.workflows.load_checkpoint("wf-0") == b"after-the-storm"


def test_a_kill_storm_does_not_wait_out_the_pools_back_off(
    postgres_base_url: str, table: str
) -> None:
    name = f"weft-storm-{uuid.uuid4().hex[:8]}"
    url = _url(postgres_base_url, f"application_name={name}")
    with PostgresStorage(
        url, table=table, min_size=8, max_size=8, renew_interval_ms=RENEW_MS
    ) as store:
        store.put("k", b"v")
        # Every pooled session dies at once; the next call must not give up after the first
        # dead one (the pool's back-off would outlast the one-interval pool timeout).
        for _ in range(3):
            assert _terminate(postgres_base_url, name) > 0
            time.sleep(0.05)  # lets the server finish closing the killed sessions
            assert store.get("k") == b"v"
            store.put("k", b"v")


def test_doctor_reports_how_the_server_replicates(postgres_base_url: str, table: str) -> None:
    url = _url(postgres_base_url, f"table={table}")
    Ownership.open(url, background="manual").close()  # creates the table doctor reads
    done = subprocess.run(
        [sys.executable, "-m", "weft_sync", "--url", url, "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    (line,) = [ln for ln in done.stdout.splitlines() if "replication:" in ln]
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None
    assert line.startswith("[info] ")  # a primary, which takes writes
    assert f"synchronous_commit={row[0]}" in line
    # The suite's cluster has no standby: nothing to fail over to.
    assert "no standby streaming" in line and "0 standby(s) streaming" in line
