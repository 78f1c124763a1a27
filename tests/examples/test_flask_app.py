"""``examples/flask_app/app.py`` through Flask's test client: jobs, resumption, refusals."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.examples.helpers import abandon, load_example, run_script
from tests.support.waiting import wait_for
from tests.workflows.helpers import holder_engine
from weft_sync.errors import WorkflowClaimLostWarning
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

POLL_S = 0.02
"""How often a wait for a job's state looks again, in seconds."""
FAST = {"claim_ttl": "900ms", "claim_renew_interval": "300ms"}

flask_example = load_example("flask_app/app.py")


def make_app(url: str, tmp_path: Path, **config: Any) -> Flask:
    return flask_example.create_app(  # type: ignore[no-any-return]
        {
            "WEFT_SYNC_URL": url,
            "WEFT_SYNC_OPTIONS": FAST,
            "JOBS_STEP_MS": 10,
            "JOBS_EVENTS_DIR": str(tmp_path),
            **config,
        }
    )


@pytest.fixture
def app(storage_url: str, tmp_path: Path) -> Iterator[Flask]:
    app = make_app(storage_url, tmp_path)
    yield app
    flask_example.shutdown(app)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def events(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("events-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_a_job_writes_one_checkpoint_per_step_and_completes(
    client: FlaskClient, storage: Storage, tmp_path: Path
) -> None:
    started = client.post("/jobs", json={"steps": 4})
    assert started.status_code == 201
    job_id = started.get_json()["id"]

    done = wait_for(
        lambda: client.get(f"/jobs/{job_id}").get_json(),
        lambda job: job["status"] == "completed",
        "the job to complete",
        poll_s=POLL_S,
    )

    pid = started.get_json()["pid"]
    assert [step for step, _, _ in done["history"]] == [1, 2, 3, 4]
    assert {(p, e) for _, p, e in done["history"]} == {(pid, 1)}
    assert done["result"] == {"steps": 4, "pid": pid, "epoch": 1}
    assert holder_engine(storage, job_id) is None
    # The job's thread logs its last event after complete() has committed, so the store can
    # say "completed" a moment before the log does.
    kinds = wait_for(
        lambda: [e["event"] for e in events(tmp_path) if e["job"] == job_id],
        lambda kinds: bool(kinds) and kinds[-1] != "step",
        "the job's last event in the log",
        poll_s=POLL_S,
    )
    assert kinds == ["started", "step", "step", "step", "step", "completed"]
    counts = client.get("/worker").get_json()["counts"]
    assert (counts["started"], counts["step"], counts["completed"]) == (1, 4, 1)


def test_requests_with_bad_input_or_unknown_jobs_are_refused(client: FlaskClient) -> None:
    assert client.post("/jobs", json={"steps": 0}).status_code == 400
    assert client.post("/jobs", json={"steps": "3"}).status_code == 400
    assert client.post("/jobs", json={"steps": True}).status_code == 400
    missing = client.get("/jobs/job-nope")
    assert missing.status_code == 404
    assert "job-nope" in missing.get_json()["error"]
    assert client.get("/healthz").get_data(as_text=True) == "ok"


def test_a_reclaimed_job_resumes_from_its_last_checkpoint(
    storage_url: str, storage: Storage, tmp_path: Path
) -> None:
    history = [[1, 111, 1], [2, 111, 1]]
    abandon(
        storage_url,
        "job-abandoned",
        flask_example.JOB_TYPE,
        input={"steps": 4},
        checkpoint=json.dumps(history).encode(),
    )
    app = make_app(storage_url, tmp_path, WEFT_SYNC_BACKGROUND="manual")
    try:
        ownership = flask_example.weft.get_ownership(app)
        ownership.run_maintenance()
        ledger = Workflows(storage)
        wait_for(
            lambda: ledger.get("job-abandoned").status,  # type: ignore[union-attr]
            lambda status: status == "completed",
            "the resumed job to complete",
            poll_s=POLL_S,
        )
    finally:
        flask_example.shutdown(app)

    final = json.loads(ledger.load_checkpoint("job-abandoned") or b"[]")
    assert final[:2] == history
    assert [step for step, _, _ in final[2:]] == [3, 4]
    assert {epoch for _, _, epoch in final[2:]} == {2}
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds == ["resumed", "step", "step", "completed"]


def test_a_deposed_worker_has_its_next_write_refused_and_stops(
    client: FlaskClient, storage: Storage, tmp_path: Path
) -> None:
    job_id = client.post("/jobs", json={"steps": 100}).get_json()["id"]
    wait_for(
        lambda: client.get(f"/jobs/{job_id}").get_json()["history"],
        lambda history: len(history) >= 1,
        "the first step",
        poll_s=POLL_S,
    )

    # An operator cancels the job from outside: the epoch rotates and the owner is deposed.
    with pytest.warns(WorkflowClaimLostWarning):
        Workflows(storage).cancel(job_id)
        refused = wait_for(
            lambda: [e for e in events(tmp_path) if e["event"] == "refused"],
            lambda found: len(found) == 1,
            "the refused write",
            poll_s=POLL_S,
        )
    assert refused[0]["job"] == job_id
    assert client.get(f"/jobs/{job_id}").get_json()["status"] == "cancelled"


def test_shutdown_stops_a_running_job_and_releases_its_claim(
    storage_url: str, storage: Storage, tmp_path: Path
) -> None:
    app = make_app(storage_url, tmp_path, JOBS_STEP_MS=50)
    try:
        client = app.test_client()
        job_id = client.post("/jobs", json={"steps": 100}).get_json()["id"]
        (worker,) = [t for t in threading.enumerate() if t.name == f"flask-{job_id}"]
    finally:
        flask_example.shutdown(app)

    assert not worker.is_alive()
    # Still running and unclaimed: another worker's reclaim pass resumes it.
    assert Workflows(storage).get(job_id).status == "running"  # type: ignore[union-attr]
    assert holder_engine(storage, job_id) is None


@pytest.mark.slow
def test_self_test_mode_runs_one_job_end_to_end() -> None:
    done = run_script("flask_app/app.py", "--self-test")

    assert (done.returncode, done.stderr) == (0, "")
    assert ": completed, 3 steps, result {" in done.stdout


def test_jobs_taken_over_at_once_all_run_at_once_not_four_at_a_time(
    storage_url: str, tmp_path: Path
) -> None:
    """After a store stall one worker may take over most jobs in one pass; its handler runs a
    whole job on a handler thread, so the app's handler threads must not queue them behind
    each other (held and renewed, so no idle worker may take them) four at a time."""
    jobs = [f"job-stalled-{i}" for i in range(12)]
    for job in jobs:
        abandon(storage_url, job, flask_example.JOB_TYPE, input={"steps": 50})
    app = make_app(storage_url, tmp_path, WEFT_SYNC_BACKGROUND="manual", JOBS_STEP_MS=100)
    try:
        ownership = flask_example.weft.get_ownership(app)
        ownership.run_maintenance(wait_handlers=0)
        seen = wait_for(
            lambda: events(tmp_path),
            lambda log: sum(e["event"] == "resumed" for e in log) == len(jobs),
            "every taken-over job to be resumed",
            poll_s=POLL_S,
        )
        # All twelve started before any finished: none waited for a free handler thread.
        assert not [e for e in seen if e["event"] == "completed"]
    finally:
        flask_example.shutdown(app)
