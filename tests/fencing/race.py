"""The race that matters, run many times: a takeover against an open fenced transaction.

Owner A holds a workflow, opens a fenced transaction and writes its row. While the transaction is
open, engine B (its clock past A's expiry) attempts the takeover. Allowed: B's takeover waits
until A committed (then B acquires), B's takeover gives up waiting (``StorageError``: busy or
lock timeout), or A's commit fails. Never allowed: B's takeover commits while A's transaction is
still open and A's write then commits too.

A runs on a thread of this process (:func:`race_threads`) or in a second process
(:func:`race_processes`, driven over a pipe by :func:`holder_process`). B always runs in this
process, so the test can watch it wait: on PostgreSQL its backend shows up in
``pg_stat_activity`` waiting for a lock; on SQLite its thread is still blocked after a pause.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import psycopg

from tests.fencing.hosts import PAST_EXPIRY_MS, RENEW_MS, START_MS, TTL_MS, HostEnv
from weft_sync import ManualClock, Ownership, OwnershipOptions
from weft_sync.errors import StorageError

WAIT_LIMIT_S = 10.0
READY_LIMIT_S = 60.0
SQLITE_PAUSE_S = 0.1
"""How long B is given to (wrongly) finish while A's SQLite transaction is open."""

WAITED = "takeover waited for A's commit"
TIMED_OUT = "takeover gave up waiting (retried later)"
A_FAILED = "A's commit failed"
VIOLATION = "takeover committed, then A's write committed"


@dataclass
class TakeoverAttempt:
    """B's takeover on a thread of its own; ``status`` is its result or the error it raised."""

    thread: threading.Thread
    status: str | None = None

    @classmethod
    def start(cls, engine: Ownership, wid: str) -> TakeoverAttempt:
        attempt = cls(threading.Thread(name=f"takeover-{wid}", target=lambda: None))

        def run() -> None:
            try:
                attempt.status = str(engine.registry.takeover(wid).status.value)
            except StorageError:
                attempt.status = "storage-error"

        attempt.thread = threading.Thread(name=f"takeover-{wid}", target=run, daemon=True)
        attempt.thread.start()
        return attempt

    def done(self) -> bool:
        return not self.thread.is_alive()


def wait_until_blocked(env: HostEnv, attempt: TakeoverAttempt, store_table: str) -> None:
    """Return once B's takeover waits for a lock (PostgreSQL) or after a pause (SQLite)."""
    if env.backend == "sqlite":
        attempt.thread.join(SQLITE_PAUSE_S)
        return
    deadline = time.monotonic() + WAIT_LIMIT_S
    with psycopg.connect(env.db_url, autocommit=True) as monitor:
        while not attempt.done() and time.monotonic() < deadline:
            row = monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE %s",
                [f"%{store_table}%"],
            ).fetchone()
            if row is not None and row[0] > 0:
                return
            time.sleep(0.005)


def classify(b_done_before_commit: bool, b_status: str | None, a_committed: bool) -> str:
    if not a_committed:
        return A_FAILED
    if b_status == "storage-error":
        return TIMED_OUT
    if b_done_before_commit and b_status == "acquired":
        return VIOLATION
    if b_status == "acquired":
        return WAITED
    return f"takeover ended {b_status}"


def store_table(env: HostEnv) -> str:
    return env.storage_url.rsplit("table=", 1)[1]


def race_threads(env: HostEnv, iterations: int) -> Counter[str]:
    """Run the race ``iterations`` times with A on a thread of this process."""
    owner, rival = env.ownership(), env.ownership()
    conn = env.connect()
    counts: Counter[str] = Counter()
    for i in range(iterations):
        wid = f"race-t-{i}"
        assert owner.registry.acquire(wid).status == "acquired"
        env.clock.advance(PAST_EXPIRY_MS)
        a_committed = False
        try:
            with owner.fenced(wid, conn):
                env.write(conn, wid, "A")
                attempt = TakeoverAttempt.start(rival, wid)
                wait_until_blocked(env, attempt, store_table(env))
                b_done_before_commit = attempt.done()
            a_committed = True
        except Exception:
            b_done_before_commit = attempt.done()
        attempt.thread.join(WAIT_LIMIT_S)
        counts[classify(b_done_before_commit, attempt.status, a_committed)] += 1
        assert (wid in env.rows()) == a_committed
        owner.registry.forget_local_claim(wid)
    return counts


# -- A in another process ---------------------------------------------------------------------


@dataclass(frozen=True)
class HolderConfig:
    storage_url: str
    env: dict[str, Any]


def holder_process(config: HolderConfig, pipe: Pipe) -> None:
    """Owner A in a process of its own: for each id received, claim, open, write, wait, commit."""
    env = HostEnv(**config.env)
    clock = ManualClock(START_MS)
    options = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
    with Ownership.open(config.storage_url, background="manual", clock=clock, options=options) as a:
        conn = env.connect()
        pipe.send("ready")
        try:
            while (wid := pipe.recv()) is not None:
                assert a.registry.acquire(wid).status == "acquired"
                try:
                    with a.fenced(wid, conn):
                        env.write(conn, wid, "A")
                        pipe.send("written")
                        assert pipe.recv() == "commit"
                    pipe.send("committed")
                except Exception as exc:
                    pipe.send(f"failed: {type(exc).__name__}")
                a.registry.forget_local_claim(wid)
        finally:
            conn.close()


def race_processes(env: HostEnv, iterations: int) -> Counter[str]:
    """Run the race ``iterations`` times with A in a second process."""
    rival = env.ownership()
    env.clock.set(START_MS + PAST_EXPIRY_MS)  # B's view: every claim A makes is already expired
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    fields = {k: getattr(env, k) for k in ("backend", "driver", "storage_url", "db_url", "table")}
    child = ctx.Process(
        target=holder_process, args=(HolderConfig(env.storage_url, fields), theirs), daemon=True
    )
    child.start()
    counts: Counter[str] = Counter()
    try:
        # A spawned interpreter starts slowly on a loaded machine.
        assert _recv(ours, READY_LIMIT_S) == "ready"
        for i in range(iterations):
            wid = f"race-p-{i}"
            ours.send(wid)
            assert _recv(ours) == "written"
            attempt = TakeoverAttempt.start(rival, wid)
            wait_until_blocked(env, attempt, store_table(env))
            b_done_before_commit = attempt.done()
            ours.send("commit")
            a_committed = _recv(ours) == "committed"
            attempt.thread.join(WAIT_LIMIT_S)
            counts[classify(b_done_before_commit, attempt.status, a_committed)] += 1
            assert (wid in env.rows()) == a_committed
            rival.registry.forget_local_claim(wid)
        ours.send(None)
        child.join(WAIT_LIMIT_S)
        assert child.exitcode == 0, child.exitcode
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    return counts


def _recv(pipe: Pipe, limit_s: float = WAIT_LIMIT_S) -> Any:
    if not pipe.poll(limit_s):
        raise TimeoutError("the holder process did not answer")
    return pipe.recv()


Runner = Callable[[HostEnv, int], Counter[str]]
