"""The Flask example under a real gunicorn: a killed and a paused worker strand no job.

Four workers (with and without ``--preload``, on SQLite and PostgreSQL) accept jobs over HTTP.
Then one worker is SIGKILLed and another SIGSTOPped (between two store transactions) until the
others have taken its jobs over, then continued. Every job must complete exactly once, none may
be left behind, and the paused worker's late writes must be refused by the store. The numbers
are printed (``-s`` shows them).

Evidence comes from two independent places: the store (each job's record, result and
checkpoint history, where every step appends ``[step, pid, epoch]``) and the per-worker event
logs the example writes (steps written, completions, refusals, resumptions, with times).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.examples.gunicorn_flask import (
    APP_SPEC,
    CONFIG,
    assert_no_stale_write_accepted,
    assert_stale_writes_refused,
    busy_probe,
    read_events,
)
from tests.examples.gunicorn_harness import (
    GunicornServer,
    alive,
    exception_lines,
    run_gunicorn,
    write_locks_held,
)
from tests.examples.job_checks import wait_until_finished, wait_until_taken_over
from weft_sync.codec import decode_holder
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage import Storage, open_storage
from weft_sync.workflows import Workflows

WORKERS = 4
JOBS = 120
STEPS = 6
STEP_MS = 300
OPTIONS = {"claim_ttl": "1500ms", "claim_renew_interval": "500ms"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)"),
]


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
    paused_s: float
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
    busy = busy_probe(backend, storage_url)
    with _serve(tmp_path, env, preload=preload) as server:
        run = _kill_pause_and_finish(server, storage, events_dir, busy)
        log = server.log()
        processes = [server.master_pid, *server.worker_pids()]

    print(
        f"\n[gunicorn {backend} preload={preload}] jobs {run.jobs}, killed 1 (pid "
        f"{run.killed_pid}), paused 1 for {run.paused_s:.1f}s (pid {run.stopped_pid}, "
        f"{run.stop_attempts} stop(s)), "
        f"stranded {run.stranded}, refused stale writes {run.refused_stale}, takeover "
        f"{run.takeover_s:.2f}s after the kill/pause, resumed by pid {run.resumed_by}"
    )
    assert _unexpected_tracebacks(log) == [], log
    assert [pid for pid in processes if alive(pid)] == [], "gunicorn left processes behind"


# The paused worker may have been stopped inside a transaction: the server ends that session
# (idle_in_transaction_session_timeout), and the worker's next write on it, once it wakes, fails
# and is logged; its claim goes back for a redrive. Only such errors are expected in the log.
_ENDED_SESSION = re.compile(
    r"(?:Error|Timeout): .*(?:terminating connection due to idle-in-transaction timeout"
    r"|server closed the connection unexpectedly)"
)


def _serve(
    tmp_path: Path, env: dict[str, str], *, workers: int = WORKERS, preload: bool = False
) -> AbstractContextManager[GunicornServer]:
    """gunicorn serving the example with its config file, logging to ``tmp_path``."""
    return run_gunicorn(
        APP_SPEC,
        log_path=tmp_path / "gunicorn.log",
        workers=workers,
        env=env,
        preload=preload,
        extra_args=["-c", CONFIG],
    )


def _unexpected_tracebacks(log: str) -> list[str]:
    """The final line of each traceback in ``log`` that is not an ended session's error."""
    return [line for line in exception_lines(log) if not _ENDED_SESSION.search(line)]


def _kill_pause_and_finish(
    server: GunicornServer, storage: Storage, events_dir: Path, busy: Callable[[int], bool]
) -> Run:
    accepted = _start_jobs(server)
    by_pid = Counter(accepted.values())
    assert len(by_pid) >= 2, f"one worker accepted every job: {by_pid}"
    (killed, _), (stopped, _) = by_pid.most_common(2)

    stop_attempts = server.stop_outside(stopped, busy)
    paused_at = time.time()
    server.signal(killed, signal.SIGKILL)
    killed_at = time.time()
    stopped_engine = _engine_of(events_dir, stopped)
    wait_until_taken_over(storage, accepted, stopped, stopped_engine)
    paused_s = time.time() - paused_at
    server.signal(stopped, signal.SIGCONT)

    ledger = Workflows(storage)
    stranded = wait_until_finished(ledger, accepted)
    log = read_events(events_dir)
    _assert_completed_exactly_once(ledger, accepted, log, killed)
    refused = assert_stale_writes_refused(log, stopped)
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
        paused_s=paused_s,
        resumed_by=dict(Counter(e["pid"] for e in resumes)),
    )


def _start_jobs(server: GunicornServer, *, count: int = JOBS, steps: int = STEPS) -> dict[str, int]:
    """POST ``count`` jobs; return job id -> the pid of the worker that accepted it."""
    accepted: dict[str, int] = {}
    for _ in range(count):
        status, body = server.request("POST", "/jobs", {"steps": steps})
        assert status == 201, body
        accepted[body["id"]] = body["pid"]
    return accepted


def _engine_of(events_dir: Path, pid: int) -> str:
    engines = {e["engine"] for e in read_events(events_dir) if e["event"] == "started"}
    mine = {e["engine"] for e in read_events(events_dir) if e.get("pid") == pid and "engine" in e}
    assert len(mine) == 1 and mine <= engines, (pid, mine)
    return mine.pop()


def _assert_completed_exactly_once(
    ledger: Workflows, accepted: dict[str, int], log: list[dict[str, Any]], killed: int
) -> None:
    completions = Counter(e["job"] for e in log if e["event"] == "completed")
    completers = {e["job"]: e["pid"] for e in log if e["event"] == "completed"}
    for job in accepted:
        record = ledger.get(job)
        assert record is not None and record.status == "completed", (job, record)
        outcome = ledger.get_outcome(job)
        steps = record.input["steps"]
        assert outcome is not None and outcome.result["steps"] == steps, (job, outcome)
        history = json.loads(ledger.load_checkpoint(job) or b"[]")
        # Every step exactly once, in order, and never written at an older epoch than the last.
        assert [step for step, _, _ in history] == list(range(1, steps + 1)), (job, history)
        epochs = [epoch for _, _, epoch in history]
        assert epochs == sorted(epochs), (job, history)
        assert outcome.result["epoch"] >= epochs[-1], (job, outcome, history)
        # One accepted complete() per job; only a SIGKILL right after it can lose the log line.
        if outcome.result["pid"] == killed:
            assert completions[job] <= 1, (job, completions[job])
        else:
            assert completions[job] == 1, (job, completions[job])
            assert completers[job] == outcome.result["pid"], (job, completers[job], outcome)


@pytest.fixture(params=[False, True], ids=["no-preload", "preload"])
def preload(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


STALL_S = 3.0
"""How long the worker stays paused inside a write: longer than the TTL."""


def test_a_worker_paused_inside_a_sqlite_write_stalls_writers_but_strands_no_job(
    sqlite_storage_url: str, tmp_path: Path
) -> None:
    """SQLite has one writer: while a paused worker holds the write lock nobody else writes.

    Nothing is decided while it is stopped (no takeover can commit either); once it continues,
    claims that expired meanwhile change hands, and every job still completes exactly once.
    """
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    env = {
        "FLASK_WEFT_SYNC_URL": sqlite_storage_url,
        "FLASK_WEFT_SYNC_OPTIONS": json.dumps(OPTIONS),
        "FLASK_JOBS_STEP_MS": str(STEP_MS),
        "FLASK_JOBS_EVENTS_DIR": str(events_dir),
    }
    with (
        open_storage(sqlite_storage_url) as storage,
        _serve(tmp_path, env) as server,
    ):
        # Longer jobs than the other runs, so the worker keeps writing while it is caught.
        accepted = _start_jobs(server, steps=2 * STEPS)
        (stopped, _), *_ = Counter(accepted.values()).most_common(1)
        stops = server.stop_when(stopped, lambda pid: bool(write_locks_held(pid)), attempts=500)
        paused_at = time.time()
        time.sleep(STALL_S)
        continued_at = time.time()
        server.signal(stopped, signal.SIGCONT)
        ledger = Workflows(storage)
        stranded = wait_until_finished(ledger, accepted)
        log = read_events(events_dir)
        _assert_completed_exactly_once(ledger, accepted, log, killed=-1)
        assert_no_stale_write_accepted(log)
        server_log = server.log()

    assert stranded == []
    during = [
        e
        for e in log
        if e["event"] == "step" and e["pid"] != stopped and paused_at < e["t"] < continued_at
    ]
    refused = Counter(e["pid"] for e in log if e["event"] == "refused")
    print(
        f"\n[gunicorn sqlite, paused inside a write] jobs {len(accepted)}, {stops} stop(s) to "
        f"catch it holding the lock, steps written by others during the {STALL_S:.1f}s pause "
        f"{len(during)}, stranded {len(stranded)}, refused writes by pid {dict(refused)}"
    )
    assert "Traceback" not in server_log, server_log


@pytest.fixture
def sqlite_storage_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}?table=t_{uuid.uuid4().hex[:16]}"


def test_gunicorn_workers_release_their_claims_when_stopped_gracefully(
    sqlite_storage_url: str, tmp_path: Path
) -> None:
    env = {"FLASK_WEFT_SYNC_URL": sqlite_storage_url, "FLASK_JOBS_STEP_MS": "1000"}
    with open_storage(sqlite_storage_url) as storage:
        with _serve(tmp_path, env, workers=2) as server:
            accepted = _start_jobs(server, count=8, steps=100)
            held = {job: _holder_engine(storage, job) for job in accepted}
        log = server.log()
        assert server.process.returncode == 0, log
        after = {job: _holder_engine(storage, job) for job in accepted}
        statuses = {Workflows(storage).get(job).status for job in accepted}  # type: ignore[union-attr]

    assert None not in held.values()
    # Still running, held by nobody: the next worker to open takes them over and resumes them.
    assert (statuses, set(after.values())) == ({"running"}, {None})
    assert "Traceback" not in log, log


def _holder_engine(storage: Storage, job: str) -> str | None:
    holder = decode_holder(storage.get(workflow_owner_holder(job)))
    return None if holder is None else holder.engine_id


def test_a_worker_that_served_no_store_request_takes_a_killed_workers_job_over(
    sqlite_storage_url: str, tmp_path: Path
) -> None:
    # One request reaches the store: the job's POST. The other worker has answered nothing but
    # /healthz, so only the config's post_worker_init hook has opened its Ownership.
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    env = {
        "FLASK_WEFT_SYNC_URL": sqlite_storage_url,
        "FLASK_WEFT_SYNC_OPTIONS": json.dumps(OPTIONS),
        "FLASK_JOBS_STEP_MS": "200",
        "FLASK_JOBS_EVENTS_DIR": str(events_dir),
    }
    with open_storage(sqlite_storage_url) as storage:
        with _serve(tmp_path, env, workers=2) as server:
            accepted = _start_jobs(server, count=1, steps=8)
            [(job, killed)] = accepted.items()
            first_engine = _holder_engine(storage, job)
            [survivor] = [pid for pid in server.worker_pids() if pid != killed]
            server.signal(killed, signal.SIGKILL)
            wait_until_taken_over(storage, accepted, killed, str(first_engine))
            stranded = wait_until_finished(Workflows(storage), accepted)
            log = server.log()
        resumed_by = {e["pid"] for e in read_events(events_dir) if e["event"] == "resumed"}
        outcome = Workflows(storage).get_outcome(job)

    assert first_engine is not None
    assert stranded == []
    assert resumed_by == {survivor}
    assert outcome is not None and outcome.result["pid"] == survivor
    assert _unexpected_tracebacks(log) == [], log
