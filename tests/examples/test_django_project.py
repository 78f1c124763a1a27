"""``examples/django_project``: migrate, check, ``manage.py weft_sync`` and runserver, for real."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.examples.helpers import EXAMPLES, WAIT_S, abandon, script_command, script_env
from weft_sync.storage import open_storage
from weft_sync.workflows import Workflows

PROJECT = EXAMPLES / "django_project"


def manage(
    db: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**script_env(), "WEFTSITE_SQLITE_PATH": str(db), **(env or {})}
    return subprocess.run(
        script_command("django_project/manage.py", *args),
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


def _sqlite_rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.execute(sql).fetchall())
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "site.sqlite3"
    done = manage(path, "migrate", "-v", "0")
    assert (done.returncode, done.stderr) == (0, "")
    return path


def test_migrate_creates_the_reports_tables_and_check_passes(db: Path) -> None:
    done = manage(db, "check")
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout
    tables = manage(
        db,
        "shell",
        "-c",
        "from django.db import connection; print(connection.introspection.table_names())",
    )
    assert "reports_report" in tables.stdout and "reports_reportevent" in tables.stdout


def test_setup_and_checks_touch_no_database(tmp_path: Path) -> None:
    never_created = tmp_path / "not-yet.sqlite3"

    done = manage(never_created, "check")

    assert done.returncode == 0, done.stderr
    assert not never_created.exists()


def test_manage_py_weft_sync_runs_cli_commands_on_the_project_database(db: Path) -> None:
    url = f"sqlite:///{db}"
    abandon(url, "report-1", "report", input={"pages": 1})

    listing = manage(db, "weft_sync", "workflows")
    assert listing.returncode == 0, listing.stderr
    assert "report-1" in listing.stdout
    claims = manage(db, "weft_sync", "claims", "--json")
    assert [c["workflow_id"] for c in json.loads(claims.stdout)] == ["report-1"]


def test_manage_py_weft_sync_maintain_resumes_an_abandoned_report_with_its_handler(
    db: Path,
) -> None:
    abandon(f"sqlite:///{db}", "report-1", "report", input={"pages": 2})
    abandon(f"sqlite:///{db}", "import-1", "import")
    env = {"WEFTSITE_STEP_SECONDS": "0.01"}

    done = manage(
        db,
        "weft_sync",
        "maintain",
        "--once",
        "--handler",
        "reports.jobs:resume_report",
        "--type",
        "report",
        env=env,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    store = open_storage(f"sqlite:///{db}")
    try:
        ledger = Workflows(store)
        outcome = ledger.get_outcome("report-1")
        assert outcome is not None and outcome.status == "completed"
        assert (outcome.result["pages"], outcome.result["resumed_after"]) == (2, 0)
        # Written by the command's engine, under the epoch its takeover minted.
        history = json.loads(ledger.load_checkpoint("report-1") or b"[]")
        assert [(page, epoch) for page, _, epoch in history] == [(1, 2), (2, 2)]
        assert ledger.get("import-1").status == "running"  # type: ignore[union-attr]
    finally:
        store.close()
    rows = _sqlite_rows(db, "SELECT kind FROM reports_reportevent WHERE job_id = 'report-1'")
    assert sorted(rows) == [("completed",), ("resumed",)]


def test_manage_py_weft_sync_maintain_uses_the_handlers_of_the_settings(db: Path) -> None:
    abandon(f"sqlite:///{db}", "report-1", "report", input={"pages": 1})
    env = {"WEFTSITE_STEP_SECONDS": "0.01"}

    # No --handler: settings.WEFT_SYNC["HANDLERS"] names reports.jobs.resume_report.
    done = manage(db, "weft_sync", "maintain", "--once", env=env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "no --handler given" not in done.stdout
    store = open_storage(f"sqlite:///{db}")
    try:
        outcome = Workflows(store).get_outcome("report-1")
        assert outcome is not None and outcome.status == "completed"
    finally:
        store.close()


def test_manage_py_weft_sync_reports_a_bad_url_without_a_traceback(db: Path) -> None:
    done = manage(db, "weft_sync", "--url", "postgres-ish://app:hunter2@db/app", "claims")

    assert done.returncode == 2
    assert "CommandError" in done.stderr and "unsupported storage URL" in done.stderr
    assert "Traceback" not in done.stderr and "hunter2" not in done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(url: str, data: bytes | None = None) -> dict[str, object]:
    with urllib.request.urlopen(url, data=data, timeout=5) as response:
        return dict(json.loads(response.read()))


def _finished(job: dict[str, object]) -> bool:
    return job["status"] == "completed" and job["completions"] != 0


def test_runserver_starts_a_job_over_http_and_completes_it(db: Path) -> None:
    port = _free_port()
    env = {**script_env(), "WEFTSITE_SQLITE_PATH": str(db), "WEFTSITE_STEP_SECONDS": "0.01"}
    server = subprocess.Popen(
        script_command("django_project/manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"),
        cwd=PROJECT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                started = _request(f"{base}/jobs/", data=b"pages=3")
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "runserver is down"
                time.sleep(0.1)
        job_id = str(started["id"])
        # The store says "completed" first; the worker records it in its Report row right after.
        while not _finished(shown := _request(f"{base}/jobs/{job_id}/")):
            assert time.monotonic() < deadline, shown
            time.sleep(0.05)
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=WAIT_S)

    assert (shown["pages_done"], shown["completions"]) == (3, 1)
    result = shown["result"]
    assert isinstance(result, dict)
    assert (result["pages"], result["resumed_after"], result["epoch"]) == (3, 0, 1)
    store = open_storage(f"sqlite:///{db}")
    try:
        history = json.loads(Workflows(store).load_checkpoint(job_id) or b"[]")
    finally:
        store.close()
    assert history == [[page, result["pid"], 1] for page in (1, 2, 3)]
    assert "Traceback" not in stderr


def test_migrate_creates_the_weft_table_so_claims_lists_at_once(db: Path) -> None:
    tables = _sqlite_rows(db, "SELECT name FROM sqlite_master WHERE type = 'table'")
    assert ("weft_kv",) in tables

    listing = manage(db, "weft_sync", "claims")

    assert listing.returncode == 0, listing.stderr
    assert "no table weft_kv" not in listing.stdout + listing.stderr
