"""A Flask app whose jobs are weft_sync workflows, driven by worker threads of the app process.

Serve it, then drive a job with curl::

    python examples/flask_app/app.py --url sqlite:///jobs.db        # http://127.0.0.1:5000
    curl -X POST localhost:5000/jobs -H 'content-type: application/json' -d '{"steps": 3}'
    curl -X POST localhost:5000/jobs/<id>/approve -H 'content-type: application/json' \\
         -d '{"by": "ann"}'
    curl localhost:5000/jobs/<id>
    curl localhost:5000/metrics

or run one job end to end through Flask's test client and exit (``--url`` defaults to a SQLite
file in a temporary directory)::

    python examples/flask_app/app.py --self-test

The app holds one ``Ownership`` per process. ``POST /jobs`` starts a workflow (claimed by this
process in the same write) and a worker thread drives it: one fenced checkpoint per step, then
a wait for the ``approval`` signal, then ``complete``. ``POST /jobs/<id>/approve`` sends that
signal; from a request of this process it wakes the worker at once, from another process (a
second gunicorn worker, a CLI) the owner's signal poll picks it up within a renew interval.
If this process dies mid-job, the claim expires and another process's maintenance pass takes
the job over (see ``cron_maintenance.py``); this process's late writes are refused by the store.

Under gunicorn, create the app in each worker (``gunicorn 'app:create_app("postgresql://…")'``):
an ``Ownership`` must not cross ``fork()``.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from flask import Flask, Response, jsonify, request

from weft_sync import EngineDeposedError, Ownership, OwnershipOptions, WeftError
from weft_sync.metrics import serialize_prometheus
from weft_sync.workflows import WorkflowNotFoundError, WorkflowStateError

_log = logging.getLogger(__name__)

JOB_TYPE = "approval-job"
APPROVAL = "approval"
MAX_STEPS = 100
WAIT_SLICE_S = 0.25
"""How long one wait for the approval lasts before the worker checks for shutdown."""


class JobRunner:
    """Starts jobs and drives each on its own worker thread; :meth:`close` stops everything.

    :param ownership: this process's ``Ownership``; closed by :meth:`close`.
    """

    def __init__(self, ownership: Ownership) -> None:
        self.ownership = ownership
        self._stop = threading.Event()
        # _lock guards _threads.
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start_job(self, steps: int) -> str:
        """Start a job workflow (claimed by this process) and its worker thread; return its id."""
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        self.ownership.workflows.start(job_id, JOB_TYPE, input={"steps": steps})
        thread = threading.Thread(
            target=self._drive, args=(job_id, steps), name=f"flask-{job_id}", daemon=True
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return job_id

    def _drive(self, job_id: str, steps: int) -> None:
        workflows = self.ownership.workflows
        try:
            for step in range(1, steps + 1):
                if self._stop.is_set():
                    return
                workflows.save_checkpoint(job_id, f"step {step} of {steps}".encode())
            approval = self._wait_for_approval(job_id)
            if approval is None:
                # Shutting down: the claim is released on close, another process resumes it.
                return
            workflows.complete(job_id, result={"steps": steps, "approved_by": approval.get("by")})
        except EngineDeposedError:
            _log.warning("job %s was cancelled or taken over elsewhere; this worker stops", job_id)
        except Exception as exc:
            _log.exception("job %s failed", job_id)
            try:
                workflows.fail(job_id, exc)
            except WeftError:
                _log.warning("could not record the failure of job %s", job_id, exc_info=True)

    def _wait_for_approval(self, job_id: str) -> dict[str, Any] | None:
        while not self._stop.is_set():
            try:
                payload = self.ownership.workflows.wait_for_signal(job_id, APPROVAL, WAIT_SLICE_S)
            except TimeoutError:
                continue
            return payload if isinstance(payload, dict) else {}
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker threads, join them, then close the ``Ownership``; idempotent."""
        self._stop.set()
        with self._lock:
            threads = list(self._threads)
            self._threads.clear()
        for thread in threads:
            thread.join(timeout)
        self.ownership.close()
        atexit.unregister(self.close)


def create_app(url: str, *, options: OwnershipOptions | None = None) -> Flask:
    """Build the app over the store at ``url``, with one ``Ownership`` for this process.

    Flask has no application-shutdown hook (``teardown_appcontext`` runs after every request),
    so the ``Ownership`` is closed by :func:`shutdown` or, failing that, at interpreter exit.
    """
    app = Flask(__name__)
    runner = JobRunner(Ownership.open(url, options=options))
    app.extensions["weft_sync"] = runner
    atexit.register(runner.close)

    @app.post("/jobs")
    def start_job() -> tuple[Response, int]:
        body = request.get_json(silent=True) or {}
        steps = body.get("steps", 3)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            return jsonify(error=f"steps must be an int from 1 to {MAX_STEPS}, got {steps!r}"), 400
        job_id = runner.start_job(steps)
        return jsonify(id=job_id, status="running"), 201

    @app.post("/jobs/<job_id>/approve")
    def approve(job_id: str) -> tuple[Response, int]:
        body = request.get_json(silent=True) or {}
        runner.ownership.workflows.send_signal(job_id, APPROVAL, {"by": str(body.get("by", "?"))})
        return jsonify(id=job_id, approval="sent"), 202

    @app.get("/jobs/<job_id>")
    def show_job(job_id: str) -> tuple[Response, int]:
        workflows = runner.ownership.workflows
        record = workflows.get(job_id)
        if record is None:
            raise WorkflowNotFoundError(job_id)
        checkpoint = workflows.load_checkpoint(job_id)
        outcome = workflows.get_outcome(job_id)
        return jsonify(
            id=job_id,
            status=record.status,
            checkpoint=None if checkpoint is None else checkpoint.decode(),
            result=None if outcome is None else outcome.result,
        ), 200

    @app.get("/metrics")
    def metrics() -> Response:
        text = serialize_prometheus(runner.ownership.metrics.snapshot())
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.errorhandler(WorkflowNotFoundError)
    def not_found(exc: WorkflowNotFoundError) -> tuple[Response, int]:
        return jsonify(error=str(exc)), 404

    @app.errorhandler(WorkflowStateError)
    def wrong_state(exc: WorkflowStateError) -> tuple[Response, int]:
        return jsonify(error=str(exc)), 409

    return app


def shutdown(app: Flask) -> None:
    """Stop the app's job threads and close its ``Ownership`` (releasing its claims)."""
    runner: JobRunner = app.extensions["weft_sync"]
    runner.close()


def self_test(url: str) -> int:
    """Start a job, approve it, wait until it completes and print /metrics; 0 when it did."""
    app = create_app(url)
    try:
        client = app.test_client()
        job_id = client.post("/jobs", json={"steps": 3}).get_json()["id"]
        print(f"started {job_id}")
        client.post(f"/jobs/{job_id}/approve", json={"by": "self-test"})
        deadline = time.monotonic() + 10
        job = client.get(f"/jobs/{job_id}").get_json()
        while job["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
            job = client.get(f"/jobs/{job_id}").get_json()
        print(
            f"{job_id}: {job['status']}, checkpoint {job['checkpoint']!r}, result {job['result']}"
        )
        print(client.get("/metrics").get_data(as_text=True), end="")
        return 0 if job["status"] == "completed" else 1
    finally:
        shutdown(app)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Flask app whose jobs are weft_sync workflows.")
    parser.add_argument("--url", help="store URL (default: a SQLite file in a temporary dir)")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--self-test", action="store_true", help="run one job, then exit")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weft-flask-") as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'jobs.db'}"
        if args.self_test:
            return self_test(url)
        app = create_app(url)
        try:
            app.run(port=args.port)
        finally:
            shutdown(app)
    return 0


if __name__ == "__main__":
    sys.exit(main())
