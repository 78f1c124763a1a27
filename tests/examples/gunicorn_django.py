"""The Django example project as its gunicorn tests run and read it.

Its database (a :class:`Site`, migrated before gunicorn starts), the ``ReportEvent`` log its
workers write, the tracebacks its gunicorn log may hold, and the check that a paused worker's
late writes were refused.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tests.examples.gunicorn_harness import exception_lines, write_locks_held
from tests.examples.helpers import EXAMPLES, script_command, script_env
from tests.support.postgres_activity import idle_in_transaction
from weft_sync.workflows import Workflows

PROJECT: Final = EXAMPLES / "django_project"
MIGRATE_TIMEOUT_S: Final = 180.0
"""A hang guard: Django's startup and migrations take half a minute on a loaded machine."""


@dataclass
class Site:
    """The project's database: how the example reaches it and how the tests read it."""

    env: dict[str, str]
    store_url: str
    query: Callable[[str], list[tuple[Any, ...]]]
    busy: Callable[[int], bool]


def migrated_sqlite_site(path: Path) -> Site:
    """The project's database in the SQLite file ``path``, migrated."""
    return _migrated(
        Site(
            env={"WEFTSITE_SQLITE_PATH": str(path)},
            store_url=f"sqlite:///{path}",
            query=lambda sql: _sqlite_query(path, sql),
            # A worker paused inside a write transaction would stall every writer.
            busy=lambda pid: bool(write_locks_held(pid)),
        )
    )


def migrated_postgres_site(url: str) -> Site:
    """The project's database in the (empty) PostgreSQL database at ``url``, migrated."""
    return _migrated(
        Site(
            env={"WEFTSITE_DATABASE_URL": url},
            store_url=url,
            query=lambda sql: _postgres_query(url, sql),
            busy=lambda pid: idle_in_transaction(url),
        )
    )


def report_events(site: Site) -> list[dict[str, Any]]:
    """Every ``ReportEvent`` row, oldest first."""
    rows = site.query("SELECT job_id, kind, page, pid, engine, at FROM reports_reportevent")
    names = ("job", "kind", "page", "pid", "engine", "at")
    return sorted((dict(zip(names, row, strict=True)) for row in rows), key=lambda e: e["at"])


# A deposed worker's complete()/fail() of a job its new owner already completed is refused (the
# store keeps the new owner's outcome), but reported as WorkflowStateError instead of
# EngineDeposedError while ledger/finishing.py checks the status before the epoch. The example
# then logs it with its traceback. What matters here is that the write was refused.
_MISREPORTED_FINISH = re.compile(
    r"weft_sync(?:\.[a-z_]+)*\.WorkflowStateError: cannot (?:complete|fail) workflow "
    r"'(?P<job>[0-9a-f]+)': its status is 'completed'"
)


def misreported_finishes(log: str, ledger: Workflows, stopped: int) -> list[str]:
    """The jobs whose finish by a deposed worker was refused as ``WorkflowStateError``."""
    jobs = []
    for line in exception_lines(log):
        match = _MISREPORTED_FINISH.search(line)
        if match is None:
            continue
        outcome = ledger.get_outcome(match["job"])
        if outcome is not None and outcome.result["pid"] != stopped:
            jobs.append(match["job"])
    return jobs


def unexpected_tracebacks(log: str, ledger: Workflows, stopped: int) -> list[str]:
    """Every traceback in ``log`` but the misreported deposed finishes."""
    known = set(misreported_finishes(log, ledger, stopped))
    return [
        line
        for line in exception_lines(log)
        if not ((m := _MISREPORTED_FINISH.search(line)) and m["job"] in known)
    ]


def assert_stale_writes_refused(
    ledger: Workflows,
    accepted: dict[str, int],
    events: list[dict[str, Any]],
    stopped: int,
    pause: tuple[float, float],
    misreported: list[str],
) -> int:
    """The paused worker's writes after the takeover were all refused; return how many.

    ``pause``: when the worker was stopped and continued (``time.time()``). ``misreported``:
    its finishes refused with the wrong error type (see :func:`misreported_finishes`);
    refused all the same, so they count.
    """
    paused_at, continued_at = pause
    refused = [e for e in events if e["kind"] == "refused" and e["pid"] == stopped]
    assert refused or misreported, "the paused worker had no write refused"
    # It owned none of its jobs after it continued (all were taken over while it was stopped):
    # completing one, or writing its last page, needed a takeover of its own first.
    retaken = {
        e["job"]
        for e in events
        if e["kind"] == "resumed" and e["pid"] == stopped and e["at"] >= continued_at
    }
    for job, owner in accepted.items():
        if owner != stopped or job in retaken:
            continue
        late = [
            e for e in events if e["job"] == job and e["pid"] == stopped and e["at"] >= continued_at
        ]
        # A "completed" event may come late when the worker was stopped between its accepted
        # complete() and recording it: the store then shows that outcome, finished before
        # the pause. Anything else after the pause must be a refusal.
        outcome = ledger.get_outcome(job)
        finished_before_pause = (
            outcome is not None
            and outcome.result["pid"] == stopped
            and outcome.finished_at <= paused_at * 1000
        )
        accepted_late = [
            e
            for e in late
            if e["kind"] != "refused" and not (e["kind"] == "completed" and finished_before_pause)
        ]
        assert accepted_late == [], ("a stale write was accepted", late, outcome)
    return len(refused) + len(misreported)


def _migrated(site: Site) -> Site:
    done = subprocess.run(
        script_command("django_project/manage.py", "migrate", "-v", "0"),
        cwd=PROJECT,
        env={**script_env(), **site.env},
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT_S,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return site


def _sqlite_query(path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path, timeout=20)
    try:
        return list(conn.execute(sql).fetchall())
    finally:
        conn.close()


def _postgres_query(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(sql).fetchall())
