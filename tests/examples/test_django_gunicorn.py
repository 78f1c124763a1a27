"""The Django example under a real gunicorn: a killed and a paused worker strand no job.

``gunicorn -w 4 weftsite.wsgi`` run in ``examples/django_project`` (so its ``gunicorn.conf.py``
applies), with and without ``--preload``, on Django's SQLite and PostgreSQL backends; the claims
live in the project's database. After the jobs are accepted over HTTP, one worker is SIGKILLed
and another SIGSTOPped until the others have taken its jobs over, then continued. Every job must
complete exactly once, none may be left behind, and the paused worker's late writes must be
refused by the store. The numbers are printed (``-s`` shows them).

Evidence comes from two places: the weft_sync store (each job's record, result, and checkpoint
history, where every page appends ``[page, pid, epoch]``) and the project's own tables (the
``Report`` rows and the ``ReportEvent`` log of resumptions, completions and refusals).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.examples.gunicorn_django import (
    PROJECT,
    Site,
    assert_stale_writes_refused,
    migrated_sqlite_site,
    misreported_finishes,
    report_events,
    unexpected_tracebacks,
)
from tests.examples.gunicorn_harness import GunicornServer, run_gunicorn
from tests.examples.job_checks import FINISH_WAIT_S, wait_until_finished, wait_until_taken_over
from weft_sync.codec import decode_holder
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage import Storage, open_storage
from weft_sync.workflows import Workflows

WORKERS = 4
JOBS = 120
CLIENTS = 4
"""HTTP requests in flight at once while the jobs are started."""
PAGES = 5
STEP_S = 0.2
CLAIM_TTL, RENEW_INTERVAL = "1500ms", "500ms"

pytestmark = [
    pytest.mark.slow,
    # A hang guard: four gunicorn workers and Django's startup take minutes on a loaded machine.
    pytest.mark.timeout(480),
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
    resumed_by: dict[int, int]
    seconds: float
    phases: dict[str, float]


@pytest.fixture(params=[False, True], ids=["no-preload", "preload"])
def preload(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_report_jobs_survive_a_killed_and_a_paused_gunicorn_worker(
    backend: str, site: Site, tmp_path: Path, preload: bool
) -> None:
    env = {
        **site.env,
        "WEFTSITE_CLAIM_TTL": CLAIM_TTL,
        "WEFTSITE_RENEW_INTERVAL": RENEW_INTERVAL,
        "WEFTSITE_STEP_SECONDS": str(STEP_S),
    }
    began = time.monotonic()
    store = open_storage(site.store_url)
    try:
        with run_gunicorn(
            "weftsite.wsgi",
            log_path=tmp_path / "gunicorn.log",
            workers=WORKERS,
            env=env,
            preload=preload,
            ready_path="/jobs/",
            cwd=PROJECT,
        ) as server:
            run = _kill_pause_and_finish(server, store, site)
            log = server.log()
            unexpected = unexpected_tracebacks(log, Workflows(store), run.stopped_pid)
    finally:
        store.close()
    run.seconds = time.monotonic() - began

    print(
        f"\n[django gunicorn {backend} preload={preload}] jobs {run.jobs}, killed 1 (pid "
        f"{run.killed_pid}), paused 1 (pid {run.stopped_pid}, {run.stop_attempts} stop(s)), "
        f"stranded {run.stranded}, refused stale writes {run.refused_stale}, takeover "
        f"{run.takeover_s:.2f}s after the kill/pause, resumed by pid {run.resumed_by}, "
        f"run {run.seconds:.1f}s ("
        + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in run.phases.items())
        + ")"
    )
    assert unexpected == [], log


def _kill_pause_and_finish(server: GunicornServer, store: Storage, site: Site) -> Run:
    phases: dict[str, float] = {}
    mark = time.monotonic()
    accepted, engines = _start_jobs(server)
    phases["post"] = time.monotonic() - mark
    (killed, _), (stopped, _) = Counter(accepted.values()).most_common(2)

    stop_attempts = server.stop_outside(stopped, site.busy)
    paused_at = time.time()
    server.signal(killed, signal.SIGKILL)
    killed_at = time.time()
    mark = time.monotonic()
    wait_until_taken_over(store, accepted, stopped, engines[stopped])
    phases["takeover"] = time.monotonic() - mark
    # Taken before the signal: every event the worker records after continuing is later.
    continued_at = time.time()
    server.signal(stopped, signal.SIGCONT)

    ledger = Workflows(store)
    mark = time.monotonic()
    stranded = wait_until_finished(ledger, accepted)
    phases["finish"] = time.monotonic() - mark
    events = _wait_for_completion_events(ledger, site, accepted, killed)
    _assert_completed_exactly_once(ledger, site, accepted, events, killed)
    misreported = misreported_finishes(server.log(), ledger, stopped)
    refused = assert_stale_writes_refused(
        ledger, accepted, events, stopped, (paused_at, continued_at), misreported
    )
    assert stranded == []
    resumes = [e for e in events if e["kind"] == "resumed"]
    takeover = max(
        e["at"] - (killed_at if accepted[e["job"]] == killed else paused_at)
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
        seconds=0.0,
        phases=phases,
    )


def _start_jobs(server: GunicornServer) -> tuple[dict[str, int], dict[int, str]]:
    """POST :data:`JOBS` jobs, a few at a time; return job -> pid, and pid -> its engine id."""
    accepted: dict[str, int] = {}
    engines: dict[int, str] = {}
    with ThreadPoolExecutor(CLIENTS, thread_name_prefix="client") as clients:
        answers = list(
            clients.map(lambda _: server.request("POST", "/jobs/", {"pages": PAGES}), range(JOBS))
        )
    for status, body in answers:
        assert status == 201, body
        accepted[body["id"]] = body["pid"]
        assert engines.setdefault(body["pid"], body["engine"]) == body["engine"], body
    assert len(engines) >= 2, f"one worker accepted every job: {engines}"
    return accepted, engines


def _wait_for_completion_events(
    ledger: Workflows, site: Site, accepted: dict[str, int], killed: int
) -> list[dict[str, Any]]:
    """The event log, once every completion accepted by a live worker has been recorded.

    The store says a job is done as soon as ``complete()`` commits; the worker records it in
    the project's tables right after, and the paused worker may have been stopped in between.
    """
    deadline = time.monotonic() + FINISH_WAIT_S
    while True:
        events = report_events(site)
        recorded = {e["job"] for e in events if e["kind"] == "completed"}
        missing = []
        for job in accepted:
            outcome = ledger.get_outcome(job)
            if outcome is not None and outcome.result["pid"] != killed and job not in recorded:
                missing.append(job)
        if not missing or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


def _assert_completed_exactly_once(
    ledger: Workflows,
    site: Site,
    accepted: dict[str, int],
    events: list[dict[str, Any]],
    killed: int,
) -> None:
    completions = Counter(e["job"] for e in events if e["kind"] == "completed")
    reports = {
        row[0]: row[1:]
        for row in site.query(
            "SELECT job_id, status, pages_done, completions, completed_by_pid FROM reports_report"
        )
    }
    assert set(reports) == set(accepted)
    for job in accepted:
        record = ledger.get(job)
        assert record is not None and record.status == "completed", (job, record)
        outcome = ledger.get_outcome(job)
        assert outcome is not None and outcome.result["pages"] == PAGES, (job, outcome)
        history = _history(ledger, job)
        # Every page exactly once, in order, and never written at an older epoch than the last.
        job_events = [e for e in events if e["job"] == job]
        assert [page for page, _, _ in history] == list(range(1, PAGES + 1)), (
            job,
            history,
            outcome.result,
            job_events,
        )
        epochs = [epoch for _, _, epoch in history]
        assert epochs == sorted(epochs), (job, history)
        assert outcome.result["epoch"] >= epochs[-1], (job, outcome, history)
        status, pages_done, count, by_pid = reports[job]
        # One accepted complete() per job; only a SIGKILL right after it can lose the rows.
        if outcome.result["pid"] == killed:
            assert completions[job] <= 1 and count <= 1, (job, completions[job], count)
        else:
            assert completions[job] == 1, (job, completions[job])
            assert (status, pages_done, count, by_pid) == (
                "completed",
                PAGES,
                1,
                outcome.result["pid"],
            ), job


def _history(ledger: Workflows, job: str) -> list[list[int]]:
    return list(json.loads(ledger.load_checkpoint(job) or b"[]"))


def test_a_graceful_restart_releases_every_claim_and_the_next_server_finishes_the_jobs(
    tmp_path: Path,
) -> None:
    site = migrated_sqlite_site(tmp_path / "site.sqlite3")
    env = {
        **site.env,
        "WEFTSITE_CLAIM_TTL": CLAIM_TTL,
        "WEFTSITE_RENEW_INTERVAL": RENEW_INTERVAL,
        "WEFTSITE_STEP_SECONDS": str(STEP_S),
    }
    serve = {"workers": 2, "env": env, "ready_path": "/jobs/", "cwd": PROJECT}
    with open_storage(site.store_url) as store:
        ledger = Workflows(store)
        with run_gunicorn("weftsite.wsgi", log_path=tmp_path / "first.log", **serve) as first:
            jobs = [first.request("POST", "/jobs/", {"pages": 10})[1]["id"] for _ in range(6)]
        first_log = first.log()
        # SIGTERM: each worker stopped its jobs between pages and released their claims.
        assert first.process.returncode == 0, first_log
        assert {ledger.get(job).status for job in jobs} == {"running"}  # type: ignore[union-attr]
        assert [_holder(store, job) for job in jobs] == [None] * len(jobs)

        with run_gunicorn("weftsite.wsgi", log_path=tmp_path / "second.log", **serve) as second:
            stranded = wait_until_finished(ledger, dict.fromkeys(jobs, 0))
        second_log = second.log()

        assert stranded == []
        for job in jobs:
            history = _history(ledger, job)
            assert [page for page, _, _ in history] == list(range(1, 11)), (job, history)
    resumed = site.query("SELECT count(*) FROM reports_reportevent WHERE kind = 'resumed'")
    assert resumed == [(len(jobs),)]
    assert "Traceback" not in first_log + second_log, first_log + second_log


def _holder(store: Storage, job: str) -> str | None:
    holder = decode_holder(store.get(workflow_owner_holder(job)))
    return None if holder is None else holder.engine_id
