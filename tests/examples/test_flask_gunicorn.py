"""The Flask example under a real gunicorn: a killed and a paused worker strand no job.

Four workers (with and without ``--preload``, on SQLite and PostgreSQL) accept jobs over HTTP.
Then one worker is SIGKILLed and another SIGSTOPped until the others have taken its jobs over,
then continued. Every job must complete exactly once, none may be left behind, and the paused
worker's late writes must be refused by the store. The numbers are printed (``-s`` shows them).

Evidence comes from two independent places: the store (each job's record, result and
checkpoint history, where every step appends ``[step, pid, epoch]``) and the per-worker event
logs the example writes (steps written, completions, refusals, resumptions, with times).
"""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.examples.gunicorn_harness import GunicornServer, run_gunicorn, write_locks_held
from weft_sync.codec import decode_holder
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

APP_SPEC = "examples.flask_app.app:create_app()"
CONFIG = "examples/flask_app/gunicorn.conf.py"
WORKERS = 4
JOBS = 120
STEPS = 6
STEP_MS = 300
OPTIONS = {"claim_ttl": "1500ms", "claim_renew_interval": "500ms"}
TAKEOVER_WAIT_S = 20.0
"""Bound for the survivors to take the paused worker's jobs over; reaching it fails the test."""
FINISH_WAIT_S = 40.0
"""Bound for every job to complete after the paused worker continues; reaching it fails."""

pytestmark = pytest.mark.slow


@dataclass
class Run:
    """What one run measured."""

    jobs: int
    stranded: int
    refused_stale: int
    killed_pid: int
    stopped_pid: int
    stop_attempts: int
    takeover_s: float
    resumed_by: dict[int, int]


def test_jobs_survive_a_killed_and_a_paused_gunicorn_worker(
    backend: str, storage_url: str, storage: Storage, tmp_path: Path, preload: bool
) -> None:
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    env = {
        "FLASK_WEFT_SYNC_URL": storage_url,
        "FLASK_WEFT_SYNC_OPTIONS": json.dumps(OPTIONS),
        "FLASK_JOBS_STEP_MS": str(STEP_MS),
        "FLASK_JOBS_EVENTS_DIR": str(events_dir),
    }
    busy = _busy_probe(backend, storage_url)
    with run_gunicorn(
        APP_SPEC,
        log_path=tmp_path / "gunicorn.log",
        workers=WORKERS,
        env=env,
        preload=preload,
        extra_args=["-c", CONFIG],
    ) as server:
        run = _kill_pause_and_finish(server, storage, events_dir, busy)
        log = server.log()

    print(
        f"\n[gunicorn {backend} preload={preload}] jobs {run.jobs}, killed 1 (pid "
        f"{run.killed_pid}), paused 1 (pid {run.stopped_pid}, {run.stop_attempts} stop(s)), "
        f"stranded {run.stranded}, refused stale writes {run.refused_stale}, takeover "
        f"{run.takeover_s:.2f}s after the kill/pause, resumed by pid {run.resumed_by}"
    )
    assert "Traceback" not in log, log


def _kill_pause_and_finish(
    server: GunicornServer, storage: Storage, events_dir: Path, busy: Callable[[int], bool]
) -> Run:
    accepted = _start_jobs(server)
    by_pid = Counter(accepted.values())
    (killed, _), (stopped, _) = by_pid.most_common(2)

    stop_attempts = server.stop_outside(stopped, busy)
    paused_at = time.time()
    server.signal(killed, signal.SIGKILL)
    killed_at = time.time()
    stopped_engine = _engine_of(events_dir, stopped)
    _wait_until_taken_over(storage, accepted, stopped, stopped_engine)
    # Taken before the signal: every event the worker logs after continuing is later than this.
    continued_at = time.time()
    server.signal(stopped, signal.SIGCONT)

    ledger = Workflows(storage)
    stranded = _wait_until_finished(ledger, accepted)
    log = _read_events(events_dir)
    _assert_completed_exactly_once(ledger, accepted, log, killed)
    refused = _assert_stale_writes_refused(log, stopped, continued_at)
    assert stranded == []
    resumes = [e for e in log if e["event"] == "resumed"]
    takeover = max(
        e["t"] - (killed_at if accepted[e["job"]] == killed else paused_at)
        for e in resumes
        if accepted[e["job"]] in (killed, stopped)
    )
    return Run(
        jobs=len(accepted),
        stranded=len(stranded),
        refused_stale=refused,
        killed_pid=killed,
        stopped_pid=stopped,
        stop_attempts=stop_attempts,
        takeover_s=takeover,
        resumed_by=dict(Counter(e["pid"] for e in resumes)),
    )


def _start_jobs(server: GunicornServer) -> dict[str, int]:
    """POST :data:`JOBS` jobs; return job id -> the pid of the worker that accepted it."""
    accepted: dict[str, int] = {}
    for _ in range(JOBS):
        status, body = server.request("POST", "/jobs", {"steps": STEPS})
        assert status == 201, body
        accepted[body["id"]] = body["pid"]
    assert len(set(accepted.values())) >= 2, f"one worker accepted every job: {accepted}"
    return accepted


def _engine_of(events_dir: Path, pid: int) -> str:
    engines = {e["engine"] for e in _read_events(events_dir) if e["event"] == "started"}
    mine = {e["engine"] for e in _read_events(events_dir) if e.get("pid") == pid and "engine" in e}
    assert len(mine) == 1 and mine <= engines, (pid, mine)
    return mine.pop()


def _wait_until_taken_over(
    storage: Storage, accepted: dict[str, int], pid: int, engine: str
) -> None:
    """Wait until no running job of the paused worker is still held by its engine."""
    ledger = Workflows(storage)
    mine = [job for job, owner in accepted.items() if owner == pid]
    deadline = time.monotonic() + TAKEOVER_WAIT_S
    while True:
        held = []
        for job in mine:
            holder = decode_holder(storage.get(workflow_owner_holder(job)))
            record = ledger.get(job)
            running = record is not None and record.status == "running"
            if running and (holder is None or holder.engine_id == engine):
                held.append(job)
        if not held:
            return
        assert time.monotonic() < deadline, f"still held by the paused worker: {held}"
        time.sleep(0.1)


def _wait_until_finished(ledger: Workflows, accepted: dict[str, int]) -> list[str]:
    """Wait for every job to leave ``running``; return those that never did (stranded)."""
    deadline = time.monotonic() + FINISH_WAIT_S
    while True:
        records = {job: ledger.get(job) for job in accepted}
        pending = [job for job, r in records.items() if r is not None and r.status == "running"]
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.1)


def _read_events(directory: Path) -> list[dict[str, Any]]:
    found = []
    for path in directory.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            # A line cut short by SIGKILL is not evidence of anything.
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return sorted(found, key=lambda e: e["t"])


def _assert_completed_exactly_once(
    ledger: Workflows, accepted: dict[str, int], log: list[dict[str, Any]], killed: int
) -> None:
    completions = Counter(e["job"] for e in log if e["event"] == "completed")
    completers = {e["job"]: e["pid"] for e in log if e["event"] == "completed"}
    for job in accepted:
        record = ledger.get(job)
        assert record is not None and record.status == "completed", (job, record)
        outcome = ledger.get_outcome(job)
        assert outcome is not None and outcome.result["steps"] == STEPS, (job, outcome)
        history = json.loads(ledger.load_checkpoint(job) or b"[]")
        # Every step exactly once, in order, and never written at an older epoch than the last.
        assert [step for step, _, _ in history] == list(range(1, STEPS + 1)), (job, history)
        epochs = [epoch for _, _, epoch in history]
        assert epochs == sorted(epochs), (job, history)
        assert outcome.result["epoch"] >= epochs[-1], (job, outcome, history)
        # One accepted complete() per job; only a SIGKILL right after it can lose the log line.
        if outcome.result["pid"] == killed:
            assert completions[job] <= 1, (job, completions[job])
        else:
            assert completions[job] == 1, (job, completions[job])
            assert completers[job] == outcome.result["pid"], (job, completers[job], outcome)


def _assert_stale_writes_refused(
    log: list[dict[str, Any]], stopped: int, continued_at: float
) -> int:
    """The paused worker's writes after the takeover were all refused; return how many."""
    refused = [e for e in log if e["event"] == "refused" and e["pid"] == stopped]
    assert refused, "the paused worker had no write refused"
    # After it continued, the paused worker owned none of its jobs (all were taken over while
    # it was stopped): a write of its accepted after that needs a takeover of its own first.
    retaken_at = {
        e["job"]: e["t"]
        for e in log
        if e["event"] == "resumed" and e["pid"] == stopped and e["t"] >= continued_at
    }
    for event in log:
        late = event["pid"] == stopped and event["t"] >= continued_at
        if late and event["event"] in ("step", "completed"):
            assert event["t"] >= retaken_at.get(event["job"], float("inf")), (
                "a stale write was accepted",
                event,
            )
    return len(refused)


def _busy_probe(backend: str, storage_url: str) -> Callable[[int], bool]:
    """Whether a stopped worker is inside a store transaction (then it is continued and retried).

    A process paused while it holds the store's write lock stalls every writer on SQLite, and
    on PostgreSQL holds its row locks; the scenario here is a worker paused between writes.
    """
    if backend == "sqlite":
        return lambda pid: bool(write_locks_held(pid))
    import psycopg

    base, _, query = storage_url.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    table = params.pop("table")
    dsn = base + ("?" + urllib.parse.urlencode(params) if params else "")

    def in_transaction(pid: int) -> bool:
        time.sleep(0.05)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND state LIKE 'idle in transaction%%' AND query LIKE %s "
                "AND now() - state_change > interval '40 milliseconds'",
                (f"%{table}%",),
            ).fetchone()
        return bool(row and row[0])

    return in_transaction


@pytest.fixture(params=[False, True], ids=["no-preload", "preload"])
def preload(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)
