"""Real faults under gunicorn: a store glitch, two kills 2 s apart, gthread workers.

Both web examples (``examples/flask_app`` and ``examples/django_project``) run under a real
gunicorn with four workers, on SQLite and PostgreSQL (claim TTL 1500 ms, renewal every 500 ms).
Their jobs are driven inside ``workflows.drive()`` by the workers' own threads, or by a handler
once a claim has changed hands. Each test lets a real fault happen while the jobs run:

- **A store glitch.** A separate session holds the store's write lock: PostgreSQL ``LOCK TABLE
  <weft table> IN ACCESS EXCLUSIVE MODE`` for 1 s, or SQLite ``BEGIN IMMEDIATE`` from another
  process for 7 s (past the store's 5 s busy timeout), and on until some driver has failed.
  Drivers whose writes fail leave their ``drive()`` blocks and their claims go back for a
  redrive: all 20 jobs complete, each exactly once. The run must also show that the glitch
  did something: a driver that failed with a storage error (the library's warning in the
  gunicorn log) and a job redriven (a ``resumed`` event with no worker killed, and the job
  finished at a higher epoch in the store). Without them it tested nothing, and fails.
- **Two worker kills 2 s apart.** SIGKILL of the worker holding the most jobs, then, 2 s
  later, of the live worker holding the most jobs then. Every job the second one held is
  resumed by a live worker's handler within :data:`RESUME_TARGET_S` of its kill (from the kill
  to the job's ``resumed`` event, both on this host's wall clock; when the store showed each
  job taken over is printed alongside), and every job completes exactly once.
- **gthread workers** (``--worker-class gthread --threads 4``): the kill and pause of
  ``test_flask_gunicorn`` and ``test_django_gunicorn`` with :data:`GTHREAD_JOBS` jobs. None is
  stranded, none completed twice, and the paused worker's late writes are refused.

Who holds what comes from the store; what the workers did comes from the examples' event logs
(Flask's ``events-<pid>.jsonl``, Django's ``ReportEvent`` rows, both stamped with the wall
clock the test reads too). Each job's checkpoint history (``[step, pid, epoch]`` per step)
must hold every step once, in order, at non-decreasing epochs. The numbers are printed (``-s``
shows them). Soaks: ``python -m pytest -m soak tests/examples/test_gunicorn_faults.py``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import psycopg
import pytest

from tests.examples import gunicorn_django, gunicorn_flask
from tests.examples.gunicorn_harness import (
    STARTUP_S,
    GunicornServer,
    alive,
    exception_lines,
    run_gunicorn,
)
from tests.examples.job_checks import (
    TAKEOVER_WAIT_S,
    wait_until_finished,
    wait_until_taken_over,
)
from tests.support.sqlite_lock import HOLD_WRITE_LOCK
from tests.support.waiting import wait_for
from weft_sync.codec import decode_holder
from weft_sync.keys import workflow_owner_holder
from weft_sync.reclaim.engine_records import read_engine_records
from weft_sync.storage import Storage, open_storage
from weft_sync.workflows import Workflows

WORKERS: Final = 4
CLIENTS: Final = 8
"""HTTP requests in flight at once while the jobs are started: more than the workers, so that
a sync worker busy with one request leaves the next to the others and all of them get jobs."""
CLAIM_TTL, RENEW_INTERVAL = "1500ms", "500ms"

GLITCH_JOBS: Final = 20
GLITCH_STEPS: Final = 8
GLITCH_STEP_S: Final = 0.3
PG_LOCK_S: Final = 1.0
SQLITE_LOCK_S: Final = 7.0
"""Longer than the SQLite store's 5 s busy timeout: writes queued behind the lock fail."""
GLITCH_EVIDENCE_WAIT_S: Final = 30.0
"""Hang guard: how long the SQLite lock is held past :data:`SQLITE_LOCK_S` until a driver fails."""

KILL_JOBS: Final = 24
KILL_STEPS: Final = 12
KILL_STEP_S: Final = 0.3
KILL_GAP_S: Final = 2.0
RESUME_TARGET_S: Final = 1.0
"""The issue's target: the second killed worker's jobs are resumed this soon after its kill."""

GTHREAD_JOBS: Final = 150
GTHREAD_ARGS: Final = ("--worker-class", "gthread", "--threads", "4")
POLL_S: Final = 0.02

pytestmark = [
    pytest.mark.soak,
    # A hang guard: four gunicorn workers, Django's startup and a 7 s lock on a loaded machine.
    pytest.mark.timeout(420),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)"),
]

# The library's warning when a drive ends unfinished because a write raised (both examples
# print WARNING lines of ``weft_sync`` to the gunicorn log).
# A drive that failed on the store: left unfinished while its claim was still held, or (the
# claim already lost locally by the time its write timed out, so nothing is left to release)
# stopped on the examples' WeftError path, "job/report <id> stopped ...; a handler resumes it".
_DRIVER_FAILED = re.compile(
    r"workflow '[^']+' \(epoch \d+\) was left unfinished: its (?:drive\(\) block|handler) "
    r"raised (?P<error>\w+)"
    r"|(?:job|report) \S+ (?P<stopped>stopped)\b[^\n]*; a handler resumes it"
)
_STORAGE_ERRORS: Final = frozenset({"StorageError", "ReadOnlyStorageError", "stopped"})
# What a write meeting the held lock raises: the library's StorageError, chained from the
# driver's own error (SQLite's busy timeout, PostgreSQL's lock_timeout or statement_timeout).
_GLITCH_ERROR = re.compile(
    r"weft_sync\.errors\.StorageError: |sqlite3\.OperationalError: database is locked$"
    r"|psycopg\.errors\.(?:LockNotAvailable|QueryCanceled): "
)

# What the paused worker's writes meet, and recover from: a row it still locked in a fenced host
# transaction when it stopped (lock_timeout), SQLite's write lock (busy timeout), or, once it
# wakes, its own sessions the server ended while it was stopped inside a transaction
# (idle_in_transaction_session_timeout).
_LOCK_TIMED_OUT = re.compile(
    r"(?:weft_sync\.errors\.StorageError|psycopg\.errors\.LockNotAvailable): "
    r".*(?:due to lock timeout|database is locked)"
    r"|: (?:consuming input failed: )?server closed the connection unexpectedly"
    r"|: terminating connection due to idle-in-transaction timeout"
    # A pool wait begun before the stop is past its timeout when the worker wakes.
    r"|couldn't get a connection after 0\.00 sec"
)


@dataclass(frozen=True, slots=True)
class Event:
    """Something a worker recorded about a job (both examples' logs, in one shape)."""

    kind: str
    job: str
    pid: int
    at: float
    """Seconds since the Unix epoch."""


class Example(Protocol):
    """One web example under gunicorn: how to serve it, start jobs, and read what it did."""

    name: str
    store_url: str
    warm_up_path: str
    """A GET that opens the worker's engine and changes nothing (see :func:`_open_engines`)."""

    def serve(
        self, log_path: Path, *, step_s: float, extra_args: Sequence[str] = ()
    ) -> AbstractContextManager[GunicornServer]: ...

    def start_jobs(self, server: GunicornServer, count: int, steps: int) -> dict[str, int]:
        """Start ``count`` jobs of ``steps`` steps; return job id -> the accepting worker's pid."""
        ...

    def events(self) -> list[Event]: ...

    def busy(self, pid: int) -> bool:
        """Whether stopped worker ``pid`` is inside a store transaction."""
        ...

    def assert_completed_exactly_once(
        self, ledger: Workflows, accepted: dict[str, int], killed: Collection[int]
    ) -> None: ...

    def assert_stale_writes_refused(
        self,
        ledger: Workflows,
        accepted: dict[str, int],
        stopped: int,
        pause: tuple[float, float],
        log: str,
    ) -> int:
        """The paused worker's late writes were refused, none accepted; return how many."""
        ...

    def tracebacks(self, log: str, ledger: Workflows, stopped: int) -> list[str]:
        """The final line of each unexpected traceback in the gunicorn ``log``."""
        ...


class FlaskExample:
    """``examples.flask_app.app:create_app()``: one thread per job, JSONL event logs."""

    name = "flask"
    warm_up_path = "/jobs/no-such-job"  # a 404, from weft.ownership (opened on first use)

    def __init__(self, backend: str, store_url: str, tmp_path: Path) -> None:
        self.store_url = store_url
        self.events_dir = tmp_path / "events"
        self.events_dir.mkdir()
        self._busy = gunicorn_flask.busy_probe(backend, store_url)

    def serve(
        self, log_path: Path, *, step_s: float, extra_args: Sequence[str] = ()
    ) -> AbstractContextManager[GunicornServer]:
        env = {
            "FLASK_WEFT_SYNC_URL": self.store_url,
            "FLASK_WEFT_SYNC_OPTIONS": json.dumps(
                {"claim_ttl": CLAIM_TTL, "claim_renew_interval": RENEW_INTERVAL}
            ),
            "FLASK_JOBS_STEP_MS": str(round(step_s * 1000)),
            "FLASK_JOBS_EVENTS_DIR": str(self.events_dir),
        }
        return run_gunicorn(
            gunicorn_flask.APP_SPEC,
            log_path=log_path,
            workers=WORKERS,
            env=env,
            extra_args=["-c", gunicorn_flask.CONFIG, *extra_args],
        )

    def start_jobs(self, server: GunicornServer, count: int, steps: int) -> dict[str, int]:
        answers = _post_jobs(server, "/jobs", {"steps": steps}, count)
        return {body["id"]: body["pid"] for body in answers}

    def events(self) -> list[Event]:
        return [
            Event(e["event"], e["job"], e["pid"], e["t"])
            for e in gunicorn_flask.read_events(self.events_dir)
        ]

    def busy(self, pid: int) -> bool:
        return self._busy(pid)

    def assert_completed_exactly_once(
        self, ledger: Workflows, accepted: dict[str, int], killed: Collection[int]
    ) -> None:
        _assert_histories_complete(ledger, accepted, "steps")
        completions = Counter(e.job for e in self.events() if e.kind == "completed")
        completers = {e.job: e.pid for e in self.events() if e.kind == "completed"}
        for job in accepted:
            outcome = ledger.get_outcome(job)
            assert outcome is not None
            # One accepted complete() per job; a SIGKILL right after it can lose the log line.
            if outcome.result["pid"] in killed:
                assert completions[job] <= 1, (job, completions[job])
            else:
                assert completions[job] == 1, (job, completions[job])
                assert completers[job] == outcome.result["pid"], (job, completers[job], outcome)
        gunicorn_flask.assert_no_stale_write_accepted(gunicorn_flask.read_events(self.events_dir))

    def assert_stale_writes_refused(
        self,
        ledger: Workflows,
        accepted: dict[str, int],
        stopped: int,
        pause: tuple[float, float],
        log: str,
    ) -> int:
        return gunicorn_flask.assert_stale_writes_refused(
            gunicorn_flask.read_events(self.events_dir), stopped
        )

    def tracebacks(self, log: str, ledger: Workflows, stopped: int) -> list[str]:
        return exception_lines(log)


class DjangoExample:
    """``weftsite.wsgi`` in ``examples/django_project``: report threads, ``ReportEvent`` rows."""

    name = "django"
    warm_up_path = "/jobs/"  # the counts; the engine opened at boot (post_worker_init)

    def __init__(self, django_site: gunicorn_django.Site) -> None:
        self.site = django_site
        self.store_url = django_site.store_url

    def serve(
        self, log_path: Path, *, step_s: float, extra_args: Sequence[str] = ()
    ) -> AbstractContextManager[GunicornServer]:
        env = {
            **self.site.env,
            "WEFTSITE_CLAIM_TTL": CLAIM_TTL,
            "WEFTSITE_RENEW_INTERVAL": RENEW_INTERVAL,
            "WEFTSITE_STEP_SECONDS": str(step_s),
        }
        return run_gunicorn(
            "weftsite.wsgi",
            log_path=log_path,
            workers=WORKERS,
            env=env,
            extra_args=extra_args,
            ready_path="/jobs/",
            cwd=gunicorn_django.PROJECT,
        )

    def start_jobs(self, server: GunicornServer, count: int, steps: int) -> dict[str, int]:
        answers = _post_jobs(server, "/jobs/", {"pages": steps}, count)
        return {body["id"]: body["pid"] for body in answers}

    def events(self) -> list[Event]:
        return [
            Event(e["kind"], e["job"], e["pid"], e["at"])
            for e in gunicorn_django.report_events(self.site)
        ]

    def busy(self, pid: int) -> bool:
        return self.site.busy(pid)

    def assert_completed_exactly_once(
        self, ledger: Workflows, accepted: dict[str, int], killed: Collection[int]
    ) -> None:
        """Every job completed once, and its ``Report`` row and completion event agree.

        The last page's row update, the completion event and ``complete()`` commit in one
        transaction, so this holds for the jobs a killed worker completed too.
        """
        _assert_histories_complete(ledger, accepted, "pages")
        completions = Counter(e.job for e in self.events() if e.kind == "completed")
        reports = {
            row[0]: tuple(row[1:])
            for row in self.site.query(
                "SELECT job_id, status, pages_done, completions, completed_by_pid "
                "FROM reports_report"
            )
        }
        assert set(reports) == set(accepted)
        for job in accepted:
            outcome = ledger.get_outcome(job)
            assert outcome is not None
            pages, pid = outcome.result["pages"], outcome.result["pid"]
            assert completions[job] == 1, (job, completions[job], pid in killed)
            assert reports[job] == ("completed", pages, 1, pid), (job, reports[job], outcome)

    def assert_stale_writes_refused(
        self,
        ledger: Workflows,
        accepted: dict[str, int],
        stopped: int,
        pause: tuple[float, float],
        log: str,
    ) -> int:
        events = gunicorn_django.report_events(self.site)
        misreported = gunicorn_django.misreported_finishes(log, ledger, stopped)
        return gunicorn_django.assert_stale_writes_refused(
            ledger, accepted, events, stopped, pause, misreported
        )

    def tracebacks(self, log: str, ledger: Workflows, stopped: int) -> list[str]:
        return gunicorn_django.unexpected_tracebacks(log, ledger, stopped)


@pytest.fixture(params=["flask", "django"])
def example(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Example:
    """The example under test, on a fresh store of the backend under test."""
    if request.param == "flask":
        return FlaskExample(backend, request.getfixturevalue("storage_url"), tmp_path)
    return DjangoExample(request.getfixturevalue("site"))


# -- the store glitch ------------------------------------------------------------------------


def test_twenty_jobs_complete_through_a_store_write_lock_under_gunicorn(
    example: Example, backend: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    with (
        open_storage(example.store_url) as store,
        example.serve(tmp_path / "gunicorn.log", step_s=GLITCH_STEP_S) as server,
    ):
        ledger = Workflows(store)
        _open_engines(server, example, store)
        accepted = example.start_jobs(server, GLITCH_JOBS, GLITCH_STEPS)
        # Every job past its first step, so that the lock lands mid-run on all of them.
        _wait_until_each_has_a_step(ledger, accepted)
        held_s = _hold_write_lock(backend, example.store_url, server)
        stranded = wait_until_finished(ledger, accepted)
        events = example.events()
        log = server.log()
        processes = [server.master_pid, *server.worker_pids()]
        completed = sum(_status(ledger, job) == "completed" for job in accepted)
        assert (completed, stranded) == (GLITCH_JOBS, []), (completed, stranded)
        example.assert_completed_exactly_once(ledger, accepted, killed=())
        higher_epoch = [job for job in accepted if _outcome_epoch(ledger, job) > 1]
        tracebacks = example.tracebacks(log, ledger, stopped=-1)
    failed = Counter(m["error"] or m["stopped"] for m in _DRIVER_FAILED.finditer(log))
    redriven = {e.job for e in events if e.kind == "resumed"}
    seconds = time.monotonic() - began

    print(
        f"\n[{example.name} gunicorn {backend}, store write lock held {held_s:.1f}s] jobs "
        f"completed {completed} of {len(accepted)}, stranded {len(stranded)}, drives failed "
        f"{dict(failed)}, jobs redriven {len(redriven)} (finished at epoch > 1: "
        f"{len(higher_epoch)}), run {seconds:.1f}s"
    )
    # Evidence that the glitch failed drivers and the claims were given back; else it tested
    # nothing. No worker was killed, so every resumption is a redrive.
    assert set(failed) & _STORAGE_ERRORS, ("the glitch failed no driver", dict(failed))
    assert redriven and higher_epoch, "no job was redriven: the glitch tested nothing"
    # The failed writes may be logged with their tracebacks (storage errors); nothing else.
    assert [line for line in tracebacks if not _GLITCH_ERROR.match(line)] == [], log
    assert [pid for pid in processes if alive(pid)] == [], "gunicorn left processes behind"


def _wait_until_each_has_a_step(ledger: Workflows, accepted: dict[str, int]) -> None:
    wait_for(
        lambda: [job for job in accepted if not ledger.load_checkpoint(job)],
        lambda waiting: not waiting,
        "every job to write a step (last value: the jobs without one)",
        timeout_s=GLITCH_EVIDENCE_WAIT_S,
        poll_s=POLL_S,
    )


def _hold_write_lock(backend: str, store_url: str, server: GunicornServer) -> float:
    """Hold the store's write lock from another session; return for how long it was held."""
    if backend == "postgres":
        dsn, table = _postgres_target(store_url)
        with psycopg.connect(dsn) as conn:
            conn.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            locked_at = time.monotonic()
            time.sleep(PG_LOCK_S)
            conn.rollback()
        return time.monotonic() - locked_at
    # The renewal can be the write that meets the busy timeout and lets the drivers queued
    # behind it through in time: the lock is held past its 7 s until a driver has failed.
    path = urllib.parse.urlsplit(store_url).path
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITE_LOCK, path, str(SQLITE_LOCK_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        locked_at = time.monotonic()
        before = len(server.log())
        deadline = locked_at + SQLITE_LOCK_S + GLITCH_EVIDENCE_WAIT_S
        while not _DRIVER_FAILED.search(server.log(), before) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=GLITCH_EVIDENCE_WAIT_S) == 0
    return time.monotonic() - locked_at


def _postgres_target(store_url: str) -> tuple[str, str]:
    """The libpq DSN of a ``postgresql://`` store URL and the name of the store's table."""
    base, _, query = store_url.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    table = params.pop("table", "weft_kv")
    return base + ("?" + urllib.parse.urlencode(params) if params else ""), table


def _outcome_epoch(ledger: Workflows, job: str) -> int:
    outcome = ledger.get_outcome(job)
    return -1 if outcome is None else int(outcome.result["epoch"])


# -- two worker kills, 2 s apart -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Takeover:
    """A job seen held by another engine: when the test's poll saw it, and the new holder's
    ``claimed_at`` (on that engine's claim clock: the server's, sampled, on PostgreSQL)."""

    seen_at: float
    claimed_at: float


@dataclass
class Kills:
    """The two kills: whom, when (``time.time()``), and what the store showed."""

    first: int
    first_held: int
    first_at: float
    second: int
    second_jobs: list[str]
    """The jobs the second worker's engine held just before its kill (at ``snapshot_at``)."""
    snapshot_at: float
    second_at: float
    takeovers: dict[str, Takeover]
    """Second worker's job -> its takeover, as the store showed it."""


def test_a_second_worker_killed_two_seconds_after_the_first_has_its_jobs_resumed_in_a_second(
    example: Example, backend: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    with (
        open_storage(example.store_url) as store,
        example.serve(tmp_path / "gunicorn.log", step_s=KILL_STEP_S) as server,
    ):
        ledger = Workflows(store)
        _open_engines(server, example, store)
        accepted = example.start_jobs(server, KILL_JOBS, KILL_STEPS)
        kills = _kill_two_workers(server, store, accepted)
        stranded = wait_until_finished(ledger, accepted)
        events = example.events()
        resumed_after = _resumed_after(ledger, events, kills)
        example.assert_completed_exactly_once(ledger, accepted, {kills.first, kills.second})
        log = server.log()
        processes = [server.master_pid, *server.worker_pids()]
        unexpected = example.tracebacks(log, ledger, stopped=-1)
    seconds = time.monotonic() - began
    seen_after = {job: t.seen_at - kills.second_at for job, t in kills.takeovers.items()}
    claimed_after = {job: t.claimed_at - kills.second_at for job, t in kills.takeovers.items()}
    worst_resume = max(resumed_after.values())
    worst_seen = max(seen_after.values(), default=0.0)

    print(
        f"\n[{example.name} gunicorn {backend}, two kills "
        f"{kills.second_at - kills.first_at:.2f}s apart] jobs {len(accepted)}, first killed pid "
        f"{kills.first} ({kills.first_held} jobs held), second pid {kills.second} "
        f"({len(kills.second_jobs)} jobs held): after its kill, seen taken over in the store "
        f"{_spread(seen_after)} (new holders' claimed_at {_spread(claimed_after)}), resumed "
        f"{_spread(resumed_after)}, resumed by "
        f"pid {dict(Counter(e.pid for e in events if e.kind == 'resumed'))}, stranded "
        f"{len(stranded)}, run {seconds:.1f}s"
    )
    assert stranded == []
    assert unexpected == [], log
    assert [pid for pid in processes if alive(pid)] == [], "gunicorn left processes behind"
    # THE ISSUE'S TARGET, asserted as measured (not widened for a loaded machine): every job
    # of the second killed worker resumed by a live worker's handler within 1 s of the kill,
    # both times on this host's wall clock. A job taken over whose handler run waits in a
    # queue for a free handler thread is held but not yet resumed: it misses the target.
    assert worst_resume <= RESUME_TARGET_S, (
        f"the second worker's jobs were resumed {worst_resume:.2f}s after its kill (all seen "
        f"taken over in the store within {worst_seen:.2f}s), target {RESUME_TARGET_S:.1f}s",
        resumed_after,
    )


def _kill_two_workers(server: GunicornServer, store: Storage, accepted: dict[str, int]) -> Kills:
    """SIGKILL the busiest worker, and :data:`KILL_GAP_S` later the busiest one left.

    Returns once the store shows every job of the second worker held elsewhere (or finished).
    """
    workers = set(accepted.values())
    assert len(workers) >= 2, f"one worker accepted every job: {Counter(accepted.values())}"
    first, first_jobs = _busiest(store, accepted, workers)
    server.signal(first, signal.SIGKILL)
    first_at = time.time()
    # Who holds what just before the second kill (the snapshot takes a few store reads).
    time.sleep(max(0.0, first_at + KILL_GAP_S - 0.1 - time.time()))
    snapshot_at = time.time()
    second, second_jobs = _busiest(store, accepted, set(_live_engines(store)) - {first})
    second_engine = _live_engines(store)[second]
    time.sleep(max(0.0, first_at + KILL_GAP_S - time.time()))
    server.signal(second, signal.SIGKILL)
    second_at = time.time()
    return Kills(
        first=first,
        first_held=len(first_jobs),
        first_at=first_at,
        second=second,
        second_jobs=second_jobs,
        snapshot_at=snapshot_at,
        second_at=second_at,
        takeovers=_watch_takeovers(store, second_jobs, second_engine),
    )


def _resumed_after(ledger: Workflows, events: list[Event], kills: Kills) -> dict[str, float]:
    """Second worker's job -> seconds from its kill to the job's first resumption elsewhere.

    A job the second worker gave up between the snapshot and its kill, resumed elsewhere by
    then, counts as resumed at once; one it completed itself before its kill is left out.
    """
    resumed_after: dict[str, float] = {}
    for job in kills.second_jobs:
        outcome = ledger.get_outcome(job)
        if outcome is not None and outcome.result["pid"] == kills.second:
            continue
        resumes = [
            e.at
            for e in events
            if e.kind == "resumed"
            and e.job == job
            and e.pid != kills.second
            and e.at >= kills.snapshot_at
        ]
        assert resumes, f"job {job} of the second killed worker was never resumed elsewhere"
        resumed_after[job] = max(0.0, min(resumes) - kills.second_at)
    return resumed_after


def _busiest(
    store: Storage, accepted: dict[str, int], candidates: Collection[int]
) -> tuple[int, list[str]]:
    """The live candidate worker whose engine holds the most jobs, and those jobs."""
    by_engine: dict[str, list[str]] = {}
    for job in accepted:
        holder = decode_holder(store.get(workflow_owner_holder(job)))
        if holder is not None:
            by_engine.setdefault(holder.engine_id, []).append(job)
    engines = _live_engines(store)
    held = {
        pid: by_engine.get(engines[pid], []) for pid in candidates if alive(pid) and pid in engines
    }
    assert held, f"no live worker left among {sorted(candidates)}"
    pid = max(held, key=lambda p: len(held[p]))
    assert held[pid], f"no live worker holds a job: {by_engine}"
    return pid, held[pid]


def _watch_takeovers(store: Storage, jobs: Sequence[str], engine: str) -> dict[str, Takeover]:
    """Poll the store until no job of ``jobs`` is held by ``engine``; job -> its takeover.

    A job whose new holder finished or released it between two polls has none.
    """
    taken: dict[str, Takeover] = {}
    pending = set(jobs)
    deadline = time.monotonic() + TAKEOVER_WAIT_S
    while pending and time.monotonic() < deadline:
        for job in sorted(pending):
            holder = decode_holder(store.get(workflow_owner_holder(job)))
            if holder is None or holder.engine_id != engine:
                pending.discard(job)
                if holder is not None:
                    taken[job] = Takeover(time.time(), holder.claimed_at / 1000)
        time.sleep(POLL_S)
    assert not pending, f"still held by the killed worker's engine: {sorted(pending)}"
    return taken


def _spread(seconds: dict[str, float]) -> str:
    if not seconds:
        return "-"
    values = sorted(seconds.values())
    return f"{values[0]:.2f}..{values[-1]:.2f}s (median {values[len(values) // 2]:.2f}s)"


# -- gthread workers -------------------------------------------------------------------------


def test_gthread_workers_strand_no_job_through_a_killed_and_a_paused_worker(
    example: Example, backend: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    with (
        open_storage(example.store_url) as store,
        example.serve(tmp_path / "gunicorn.log", step_s=0.2, extra_args=GTHREAD_ARGS) as server,
    ):
        ledger = Workflows(store)
        _open_engines(server, example, store)
        accepted = example.start_jobs(server, GTHREAD_JOBS, 5)
        by_pid = Counter(accepted.values())
        assert len(by_pid) >= 2, f"one worker accepted every job: {by_pid}"
        # Queued jobs a worker's threads do not pick up in time go to handlers anywhere, so
        # who holds what now is read from the store: the two workers holding the most.
        engines = _live_engines(store)

        def most_held(among: Collection[int]) -> int | None:
            """The worker of ``among`` that holds the most running jobs now, if any holds one."""
            held = _held_by(store, ledger, accepted)
            counts = {pid: len(held.get(engines[pid], [])) for pid in among}
            best = max(counts, key=counts.__getitem__, default=None)
            return best if best is not None and counts[best] else None

        def holding(pid: int) -> bool:
            # On SQLite a worker stopped inside a transaction would keep the database's write
            # lock for the whole pause, so no one could take its work over; on PostgreSQL it
            # keeps only its own rows, freed when the server ends its idle transaction (and
            # with gthread workers it is nearly always inside one while it holds jobs).
            if backend == "sqlite" and example.busy(pid):
                return False
            return bool(_held_by(store, ledger, accepted).get(engines[pid]))

        # Paused while it holds running jobs, so that its writes after waking meet the fence.
        # The worker is chosen again at each try: on a loaded machine the one that held the
        # most a moment ago may have finished its jobs by the time it is stopped.
        stopped, stop_attempts = server.stop_one_when(lambda: most_held(by_pid), holding)
        paused_at = time.time()
        held_at_pause = _held_by(store, ledger, accepted)[engines[stopped]]
        others = [pid for pid in by_pid if pid != stopped]
        killed = most_held(others) or others[0]
        server.signal(killed, signal.SIGKILL)
        wait_until_taken_over(
            store, dict.fromkeys(held_at_pause, stopped), stopped, engines[stopped]
        )
        continued_at = time.time()
        server.signal(stopped, signal.SIGCONT)

        stranded = wait_until_finished(ledger, accepted)
        completed = sum(_status(ledger, job) == "completed" for job in accepted)
        example.assert_completed_exactly_once(ledger, accepted, {killed})
        log = server.log()
        refused = example.assert_stale_writes_refused(
            ledger, accepted, stopped, (paused_at, continued_at), log
        )
        # A write that meets a row the paused worker still locks (its fenced host transaction
        # was open when it stopped) fails on the lock timeout, which the library reports and
        # recovers from (the claim released, or left to expire): not unexpected here.
        unexpected = [
            line
            for line in example.tracebacks(log, ledger, stopped)
            if not _LOCK_TIMED_OUT.search(line)
        ]
        processes = [server.master_pid, *server.worker_pids()]
    seconds = time.monotonic() - began

    print(
        f"\n[{example.name} gunicorn gthread {backend}] jobs completed {completed} of "
        f"{len(accepted)} (accepted by pid {dict(by_pid)}), killed pid {killed}, paused pid "
        f"{stopped} ({stop_attempts} stop(s)) for {continued_at - paused_at:.1f}s, stranded "
        f"{len(stranded)}, refused stale writes {refused}, run {seconds:.1f}s"
    )
    assert stranded == []
    assert completed == len(accepted)
    assert unexpected == [], log
    assert [pid for pid in processes if alive(pid)] == [], "gunicorn left processes behind"


# -- shared ----------------------------------------------------------------------------------


def _open_engines(server: GunicornServer, example: Example, store: Storage) -> None:
    """Wait until every worker has its engine open, sending it requests that open it.

    A worker still booting takes no request (the first one up would take every job), and a
    Flask worker opens its engine on first use: one that served no request takes nothing over.
    """
    deadline = time.monotonic() + STARTUP_S
    while True:
        workers = server.worker_pids()
        missing = sorted(set(workers) - set(_live_engines(store)))
        if len(workers) >= WORKERS and not missing:
            return
        assert time.monotonic() < deadline, f"workers {missing} never opened an engine"
        with ThreadPoolExecutor(CLIENTS, thread_name_prefix="client") as clients:
            list(clients.map(lambda _: server.request("GET", example.warm_up_path), range(CLIENTS)))
        time.sleep(0.05)


def _post_jobs(server: GunicornServer, path: str, body: Any, count: int) -> list[dict[str, Any]]:
    """POST ``count`` jobs, :data:`CLIENTS` at a time; return the answers' bodies."""
    with ThreadPoolExecutor(CLIENTS, thread_name_prefix="client") as clients:
        answers = list(clients.map(lambda _: server.request("POST", path, body), range(count)))
    for status, answer in answers:
        assert status == 201, answer
    return [answer for _, answer in answers]


def _held_by(store: Storage, ledger: Workflows, jobs: Collection[str]) -> dict[str, list[str]]:
    """Engine id -> the running ``jobs`` whose claim it holds, from the store."""
    held: dict[str, list[str]] = {}
    for job in jobs:
        holder = decode_holder(store.get(workflow_owner_holder(job)))
        if holder is not None and _status(ledger, job) == "running":
            held.setdefault(holder.engine_id, []).append(job)
    return held


def _live_engines(store: Storage) -> dict[int, str]:
    """Worker pid -> the id of its open engine, from the engine records in the store."""
    return {
        record.pid: record.engine_id
        for _, _, record in read_engine_records(store)
        if record is not None and record.state == "live"
    }


def _status(ledger: Workflows, job: str) -> str | None:
    record = ledger.get(job)
    return None if record is None else record.status


def _assert_histories_complete(ledger: Workflows, accepted: dict[str, int], size: str) -> None:
    """Every job completed, each of its ``input[size]`` steps written once, in order.

    The checkpoint history is ``[step, pid, epoch]`` per step: never written at an older epoch
    than the step before, and the completion at an epoch no older than the last step.
    """
    for job in accepted:
        record = ledger.get(job)
        assert record is not None and record.status == "completed", (job, record)
        steps = record.input[size]
        outcome = ledger.get_outcome(job)
        assert outcome is not None and outcome.result[size] == steps, (job, outcome)
        history = json.loads(ledger.load_checkpoint(job) or b"[]")
        assert [step for step, _, _ in history] == list(range(1, steps + 1)), (job, history)
        epochs = [epoch for _, _, epoch in history]
        assert epochs == sorted(epochs), (job, history)
        assert outcome.result["epoch"] >= epochs[-1], (job, outcome, history)
