"""``examples/flask_app/app.py``: jobs driven by worker threads, approved from another request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families

from tests.examples.helpers import load_example, run_script
from tests.workflows.helpers import holder_engine
from weft_sync import OwnershipOptions
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

WAIT_S = 10.0

flask_example = load_example("flask_app/app.py")


@pytest.fixture
def app(storage_url: str) -> Iterator[Flask]:
    # A short renew interval, so the active-claims gauge follows the jobs within a test.
    options = OwnershipOptions(claim_ttl="1s", claim_renew_interval="100ms")
    app = flask_example.create_app(storage_url, options=options)
    yield app
    flask_example.shutdown(app)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def wait_for(probe: Callable[[], Any], accept: Callable[[Any], bool], what: str) -> Any:
    """Call ``probe`` until ``accept`` likes its value; fail after :data:`WAIT_S` seconds."""
    deadline = time.monotonic() + WAIT_S
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value {value!r}")
        time.sleep(0.02)


def active_claims(client: FlaskClient) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["weft_workflow_claims_active"].samples[0].value


def test_a_job_checkpoints_waits_for_approval_and_completes(
    client: FlaskClient, storage: Storage
) -> None:
    started = client.post("/jobs", json={"steps": 3})
    assert started.status_code == 201
    job_id = started.get_json()["id"]

    waiting = wait_for(
        lambda: client.get(f"/jobs/{job_id}").get_json(),
        lambda job: job["checkpoint"] == "step 3 of 3",
        "the last checkpoint",
    )
    assert (waiting["status"], waiting["result"]) == ("running", None)
    assert holder_engine(storage, job_id) is not None
    wait_for(lambda: active_claims(client), lambda n: n == 1, "the gauge to count the job")

    approved = client.post(f"/jobs/{job_id}/approve", json={"by": "ann"})
    assert approved.status_code == 202

    done = wait_for(
        lambda: client.get(f"/jobs/{job_id}").get_json(),
        lambda job: job["status"] == "completed",
        "the job to complete",
    )
    assert done["result"] == {"steps": 3, "approved_by": "ann"}
    assert holder_engine(storage, job_id) is None
    wait_for(lambda: active_claims(client), lambda n: n == 0, "the gauge to drop the job")


def test_metrics_are_prometheus_text_with_every_family(client: FlaskClient) -> None:
    response = client.get("/metrics")

    assert response.status_code == 200
    assert response.content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = response.get_data(as_text=True)
    for family, kind in (
        ("weft_workflow_claim_attempts_total", "counter"),
        ("weft_workflow_claims_active", "gauge"),
        ("weft_workflow_claim_renewal_failures_total", "counter"),
    ):
        assert f"# TYPE {family} {kind}" in text.splitlines()
    assert 'weft_workflow_claim_attempts_total{outcome="takeover"} 0' in text.splitlines()


def test_requests_naming_bad_input_or_unknown_jobs_are_refused(client: FlaskClient) -> None:
    assert client.post("/jobs", json={"steps": 0}).status_code == 400
    assert client.post("/jobs", json={"steps": "3"}).status_code == 400
    assert client.get("/jobs/job-nope").status_code == 404
    missing = client.post("/jobs/job-nope/approve", json={"by": "ann"})
    assert missing.status_code == 404
    assert "job-nope" in missing.get_json()["error"]


def test_approving_a_finished_job_is_a_conflict(client: FlaskClient) -> None:
    job_id = client.post("/jobs", json={"steps": 1}).get_json()["id"]
    client.post(f"/jobs/{job_id}/approve", json={"by": "ann"})
    wait_for(
        lambda: client.get(f"/jobs/{job_id}").get_json()["status"],
        lambda status: status == "completed",
        "the job to complete",
    )

    again = client.post(f"/jobs/{job_id}/approve", json={"by": "bob"})

    assert again.status_code == 409
    assert "completed" in again.get_json()["error"]


def test_shutdown_stops_a_waiting_job_and_releases_its_claim(
    storage_url: str, storage: Storage
) -> None:
    app = flask_example.create_app(storage_url)
    try:
        client = app.test_client()
        job_id = client.post("/jobs", json={"steps": 2}).get_json()["id"]
        wait_for(
            lambda: client.get(f"/jobs/{job_id}").get_json()["checkpoint"],
            lambda checkpoint: checkpoint == "step 2 of 2",
            "the last checkpoint",
        )
        (worker,) = [t for t in threading.enumerate() if t.name == f"flask-{job_id}"]
    finally:
        flask_example.shutdown(app)

    assert not worker.is_alive()
    # Still running and unclaimed: any other process's maintenance pass resumes it.
    assert Workflows(storage).get(job_id).status == "running"  # type: ignore[union-attr]
    assert holder_engine(storage, job_id) is None


@pytest.mark.slow
def test_self_test_mode_runs_one_job_end_to_end() -> None:
    done = run_script("flask_app/app.py", "--self-test")

    assert (done.returncode, done.stderr) == (0, "")
    assert ": completed, checkpoint 'step 3 of 3'" in done.stdout
    assert "# TYPE weft_workflow_claims_active gauge" in done.stdout
