"""``Ownership.close(timeout)`` on SQLite ends by its bound while another process holds the lock.

Another process holds the database's write lock (``BEGIN IMMEDIATE`` on its own connection,
kept open) while the engine holds claims and a maintenance pass is writing; the store's busy
timeout is a minute, so a wait the close did not bound would outlast the test's join guards.
Asserted: the close returns with the store closed and every thread joined, the claims it could
not release are forgotten locally with one warning saying how many and why, and afterwards the
store is intact and another engine takes the claims over once they expire.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.claims.gated import Worker
from tests.support.waiting import wait_until
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync.clock import ManualClock
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import SqliteStorage, Storage, open_storage
from weft_sync.storage.sqlite import fork as sqlite_fork

TTL_MS = 600
RENEW_MS = 200
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
START_MS = 1_000_000
# Past the holder's expiry and the takeover grace.
EXPIRED_MS = START_MS + TTL_MS + 2 * RENEW_MS + 1
IDS = [f"wf-{i}" for i in range(5)]

_HOLD_WRITE_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
conn.close()
"""


@contextlib.contextmanager
def write_lock_in_another_process(db_path: Path) -> Iterator[None]:
    """Run a process that holds the database's write lock until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_WRITE_LOCK, str(db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()


def _transactions(storage: Storage) -> int:
    assert isinstance(storage, SqliteStorage)
    writer = storage._writer
    return 0 if writer is None else writer.fast_commits + writer.group_commits


def _library_threads() -> list[str]:
    """The writer, maintenance and release threads still running."""
    return [t.name for t in threading.enumerate() if t.name.startswith("weft")]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def url(db_path: Path) -> str:
    return f"sqlite:///{db_path}?busy_timeout_ms=60000"


def test_close_under_a_foreign_write_lock_forgets_the_claims_and_closes_the_store(
    url: str, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warned: list[Warning] = []
    clock = ManualClock(START_MS)
    victim = Ownership.open(
        url, options=OPTIONS, clock=clock, background="manual", warn=warned.append
    )
    for wid in IDS:
        victim.workflows.start(wid, "job")
    store = victim.storage
    with write_lock_in_another_process(db_path), caplog.at_level(logging.WARNING):
        clock.advance(RENEW_MS)  # the claims are due for renewal
        before = _transactions(store)
        maintenance = Worker(victim.run_maintenance, "maintenance-pass")
        wait_until(lambda: _transactions(store) > before, "the renewal to start writing")
        victim.close(timeout=0.3)
        assert victim.closed
        maintenance.join()
        assert victim.registry.list_held_workflow_ids() == []
        assert _library_threads() == []
        assert store not in sqlite_fork.live()
    released = [r.getMessage() for r in caplog.records if "could not release" in r.getMessage()]
    assert len(released) == 1
    assert f"could not release {len(IDS)} of {len(IDS)} claims" in released[0]
    assert "close deadline" in released[0]
    assert warned == []  # nothing was lost: the claims were given up by close()
    # Nothing was released and nothing half-written: each claim is left to expire as it was.
    with contextlib.closing(open_storage(url)) as after:
        for wid in IDS:
            assert holder_engine(after, wid) == victim.engine_id
            assert stored_epoch(after, wid) == 1


def test_close_with_interval_maintenance_joins_every_thread_under_the_lock(
    url: str, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Real time: the timer starts a renewal pass every 200 ms, which then waits for the lock.
    victim = Ownership.open(
        url, options=OwnershipOptions(claim_ttl=30_000, claim_renew_interval=200)
    )
    for wid in IDS:
        victim.workflows.start(wid, "job")
        victim.drivers.enter(wid, 1, "test thread")  # driven: only close() releases them
    store = victim.storage
    with write_lock_in_another_process(db_path), caplog.at_level(logging.WARNING):
        before = _transactions(store)
        wait_until(lambda: _transactions(store) > before, "a renewal pass to start writing")
        victim.close(timeout=0.3)
        assert victim.closed
        assert victim.registry.list_held_workflow_ids() == []
        assert _library_threads() == []
        assert store not in sqlite_fork.live()
    assert any(
        f"could not release {len(IDS)} of {len(IDS)} claims" in r.getMessage()
        for r in caplog.records
    )
    with contextlib.closing(open_storage(url)) as after:
        assert all(holder_engine(after, wid) == victim.engine_id for wid in IDS)


def test_claims_left_by_a_bounded_close_are_taken_over_once_they_expire(
    url: str, db_path: Path
) -> None:
    victim = Ownership.open(url, options=OPTIONS, clock=ManualClock(START_MS), background="manual")
    for wid in IDS:
        victim.workflows.start(wid, "job")
    with write_lock_in_another_process(db_path):
        victim.close(timeout=0.2)
    reclaimed: list[str] = []
    lock = threading.Lock()

    def on_reclaimed(workflow_id: str) -> None:
        with lock:
            reclaimed.append(workflow_id)

    with Ownership.open(
        url,
        options=OPTIONS,
        clock=ManualClock(EXPIRED_MS),
        background="manual",
        on_reclaimed=on_reclaimed,
    ) as survivor:
        survivor.run_maintenance()
        wait_until(lambda: len(reclaimed) == len(IDS), "every workflow to be reclaimed")
        assert sorted(survivor.registry.list_held_workflow_ids()) == IDS
        for wid in IDS:
            assert holder_engine(survivor.storage, wid) == survivor.engine_id
            assert stored_epoch(survivor.storage, wid) == 2
    assert sorted(reclaimed) == IDS


def test_close_without_the_lock_still_releases_every_claim(url: str) -> None:
    victim = Ownership.open(url, options=OPTIONS, clock=ManualClock(START_MS), background="manual")
    for wid in IDS:
        victim.workflows.start(wid, "job")
    victim.close(timeout=0)  # past the bound a free lock is still taken
    with contextlib.closing(open_storage(url)) as after:
        assert all(holder_engine(after, wid) is None for wid in IDS)
        assert all(stored_epoch(after, wid) == 1 for wid in IDS)


class _RecordsBounds:
    """A thin wrapper over a real store that records the bounds set on it."""

    def __init__(self, inner: SqliteStorage) -> None:
        self.inner = inner
        self.bounds: list[float | None] = []

    def bound_waits(self, deadline: float | None) -> None:
        self.bounds.append(deadline)
        self.inner.bound_waits(deadline)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_store_the_engine_did_not_open_gets_its_bound_lifted_and_stays_open(
    db_path: Path,
) -> None:
    with SqliteStorage(db_path, busy_timeout_ms=60000) as inner:
        store = _RecordsBounds(inner)
        victim = Ownership.open(
            store,  # type: ignore[arg-type]
            options=OPTIONS,
            clock=ManualClock(START_MS),
            background="manual",
        )
        victim.workflows.start("wf-0", "job")
        victim.close(timeout=5)
        assert len(store.bounds) == 2
        assert isinstance(store.bounds[0], float) and store.bounds[1] is None
        assert holder_engine(inner, "wf-0") is None
        # Still open and writable.
        inner.put("after", b"1")
        assert inner.get("after") == b"1"
