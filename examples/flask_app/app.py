"""A Flask app whose jobs are weft_sync workflows: started over HTTP, resumed after a crash.

Run it from the repository root (the store defaults to ``instance/weft_sync.db``)::

    flask --app examples.flask_app.app run
    gunicorn -w 4 -b 127.0.0.1:8000 -c examples/flask_app/gunicorn.conf.py \\
        'examples.flask_app.app:create_app()'

    curl -X POST localhost:8000/jobs -H 'content-type: application/json' -d '{"steps": 5}'
    curl localhost:8000/jobs/<id>       # status, steps done (by which worker), result
    curl localhost:8000/worker          # this worker's counts: steps, completions, refusals

or run one job end to end through Flask's test client and exit::

    python examples/flask_app/app.py --self-test

Config comes from Flask's prefixed environment (``FLASK_WEFT_SYNC_URL=postgresql://…``,
``FLASK_WEFT_SYNC_OPTIONS='{"claim_ttl": "30s", "claim_renew_interval": "5s"}'``,
``FLASK_JOBS_STEP_MS=200``, ``FLASK_JOBS_EVENTS_DIR=/tmp/events``); ``WEFT_SYNC_URL`` works
too, as for the ``weft-sync`` command.

How it works: ``POST /jobs`` starts a workflow (created and claimed by the worker that accepted
the request, in one write) and a thread of that worker drives it inside
``workflows.drive()``, one step at a time; each step is a fenced checkpoint write that appends
``[step, pid, epoch]`` to the job's history. If the job thread fails (a store glitch, a bug),
leaving ``drive()`` releases the claim at once and a handler resumes the job. When a worker
dies, its crash is seen (or, for a frozen worker, its claims expire) and another worker's
``Ownership`` takes the jobs over and calls :func:`resume_job` (the handler registered for the
job type) on one of its handler threads, which continues each from its last checkpoint. Under
gunicorn with ``gunicorn.conf.py`` every worker opens its ``Ownership`` as it boots; elsewhere
(``flask run``) it opens at the first request that uses the store (``/worker`` and ``/healthz``
do not), and only an open one takes jobs over.

Pools: on PostgreSQL give the store's pool (``?max_size=`` in the URL) at least one connection
per job thread that may write at once, plus ``handler_workers`` (32 in this app,
:data:`JOB_HANDLER_WORKERS`) and a few for maintenance.

A worker that was only paused and wakes up after the
takeover has its next write refused by the store (``EngineDeposedError``) and drops the job.
With ``JOBS_EVENTS_DIR`` set, every worker appends what happened (steps written, completions,
refusals, resumptions, with the time each write was issued and logged) to
``events-<pid>.jsonl`` there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flask import Flask, Response, current_app, jsonify, request

from weft_sync import EngineDeposedError, Ownership, WeftError, WorkflowClaimUnavailableError
from weft_sync.errors import ClosedError
from weft_sync.flask import WeftSync
from weft_sync.metrics import serialize_prometheus
from weft_sync.workflows import WorkflowStateError

_log = logging.getLogger(__name__)

JOB_TYPE = "flask-job"
MAX_STEPS = 100
JOBS_KEY = "flask_jobs"
"""Where the app keeps its :class:`Jobs` in ``app.extensions``."""

weft = WeftSync()


@weft.handler(JOB_TYPE)
def resume_job(ctx: Any) -> None:
    """Continue a job this worker took over, from its last checkpoint.

    Runs on one of the engine's handler threads (never a maintenance thread), inside an app
    context, as the job's driver: the whole job runs here.
    """
    jobs_of(current_app).resume(ctx.ownership, ctx.workflow_id, ctx.epoch)


class Events:
    """This process's counts, and (optionally) its event log ``events-<pid>.jsonl``.

    One line per event, flushed as it is written so a killed worker's log is complete up to
    the kill.
    """

    def __init__(self, directory: str | None) -> None:
        self._directory = directory
        # _lock guards _counts, _pid and _file.
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._pid = -1
        self._file: Any = None

    def record(self, event: str, job_id: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "job": job_id, "t": time.time(), **fields})
        with self._lock:
            if self._pid != os.getpid():
                # A forked worker starts its own counts and log.
                self._pid, self._counts, self._file = os.getpid(), {}, None
            self._counts[event] = self._counts.get(event, 0) + 1
            if self._directory is not None:
                if self._file is None:
                    path = Path(self._directory) / f"events-{self._pid}.jsonl"
                    self._file = path.open("a", encoding="utf-8")
                # Writing under the lock keeps lines whole; a local file, no store I/O.
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            log, self._file = self._file, None
        if log is not None:
            log.close()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts) if self._pid == os.getpid() else {}


class Jobs:
    """Drives this process's jobs, one thread each; :meth:`close` stops and joins them."""

    def __init__(self, step_ms: int, events: Events) -> None:
        self.step_s = step_ms / 1000
        self.events = events
        self._stop = threading.Event()
        # _lock guards _threads.
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, ownership: Ownership, steps: int) -> str:
        """Create and claim a job workflow, then drive it on a new thread; return its id."""
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        ownership.workflows.start(job_id, JOB_TYPE, input={"steps": steps})
        epoch = ownership.registry.current_epoch(job_id)
        self.events.record(
            "started", job_id, pid=os.getpid(), epoch=epoch, engine=ownership.engine_id
        )
        self._spawn(ownership, job_id, epoch)
        return job_id

    def resume(self, ownership: Ownership, job_id: str, epoch: int) -> None:
        """Drive a job this process took over at ``epoch``, on the calling (handler) thread."""
        self.events.record(
            "resumed", job_id, pid=os.getpid(), epoch=epoch, engine=ownership.engine_id
        )
        self._drive(ownership, job_id, epoch)

    def _spawn(self, ownership: Ownership, job_id: str, epoch: int | None) -> None:
        thread = threading.Thread(
            target=self._drive,
            args=(ownership, job_id, epoch),
            name=f"flask-{job_id}",
            daemon=True,
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _drive(self, ownership: Ownership, job_id: str, epoch: int | None) -> None:
        """Drive the job inside ``workflows.drive()``: if this raises or stops early, the claim
        is released at once and a handler (in this worker or another) resumes the job."""
        pid = os.getpid()
        workflows = ownership.workflows
        step = 0
        try:
            with workflows.drive(job_id) as ctx:
                epoch = ctx.epoch
                record = workflows.get(job_id)
                assert record is not None and isinstance(record.input, dict)
                steps = int(record.input["steps"])
                history: list[list[int]] = json.loads(workflows.load_checkpoint(job_id) or b"[]")
                for step in range(len(history) + 1, steps + 1):
                    if self._stop.wait(self.step_s):
                        # Shutting down: leaving the block releases the claim, and another
                        # worker resumes the job from this checkpoint.
                        return
                    history.append([step, pid, epoch])
                    # When the write was issued: a write issued after a takeover is refused.
                    issued = time.time()
                    ctx.checkpoint(json.dumps(history).encode())
                    self.events.record(
                        "step", job_id, pid=pid, epoch=epoch, step=step, issued=issued
                    )
                step = steps + 1
                issued = time.time()
                ctx.complete({"steps": steps, "pid": pid, "epoch": epoch})
                self.events.record("completed", job_id, pid=pid, epoch=epoch, issued=issued)
        except EngineDeposedError:
            # Another worker took the job over while this one was stalled: the store refused.
            self.events.record("refused", job_id, pid=pid, epoch=epoch, step=step)
            _log.warning("job %s: this worker was deposed; the new owner drives it", job_id)
        except (WorkflowStateError, WorkflowClaimUnavailableError) as exc:
            self.events.record("refused", job_id, pid=pid, epoch=epoch, step=step)
            _log.warning("job %s is no longer running here: %s", job_id, exc)
        except ClosedError:
            # This worker is exiting: its claims are released and another worker resumes.
            self.events.record("stopped", job_id, pid=pid, epoch=epoch, step=step)
        except WeftError:
            # drive() released the claim: a handler resumes the job, here or elsewhere.
            _log.exception("job %s stopped; a handler resumes it", job_id)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the job threads and join them; idempotent."""
        self._stop.set()
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout)
        self.events.close()


def jobs_of(app: Flask) -> Jobs:
    jobs: Jobs = app.extensions[JOBS_KEY]
    return jobs


JOB_HANDLER_WORKERS = 32
"""Default ``handler_workers`` of the app. :func:`resume_job` runs a whole job on a handler
thread, so this bounds how many taken-over jobs run at once in one worker. After a stall of the
store (a paused SQLite writer) every claim has expired at once and the first worker to reclaim
may take over most jobs of every worker: with the library's default of 4 they would run four at
a time, held (and renewed) but queued, while the other workers sit idle. On PostgreSQL the
store's pool must then allow job threads + this + 4 connections."""


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """Build the app; nothing is opened until the first request that needs the store."""
    app = Flask(__name__)
    app.config.from_mapping(JOBS_STEP_MS=200, JOBS_EVENTS_DIR=None)
    if "WEFT_SYNC_URL" in os.environ:
        app.config["WEFT_SYNC_URL"] = os.environ["WEFT_SYNC_URL"]
    app.config.from_prefixed_env()
    if config is not None:
        app.config.update(config)
    options = app.config.get("WEFT_SYNC_OPTIONS") or {}
    if isinstance(options, Mapping):
        app.config["WEFT_SYNC_OPTIONS"] = {"handler_workers": JOB_HANDLER_WORKERS, **options}
    weft.init_app(app)
    app.extensions[JOBS_KEY] = Jobs(
        int(app.config["JOBS_STEP_MS"]), Events(app.config["JOBS_EVENTS_DIR"])
    )
    _add_routes(app)
    return app


def _add_routes(app: Flask) -> None:
    @app.post("/jobs")
    def start_job() -> tuple[Response, int]:
        body = request.get_json(silent=True) or {}
        steps = body.get("steps", 3)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            return jsonify(error=f"steps must be an int from 1 to {MAX_STEPS}, got {steps!r}"), 400
        job_id = jobs_of(app).start(weft.ownership, steps)
        return jsonify(id=job_id, status="running", pid=os.getpid()), 201

    @app.get("/jobs/<job_id>")
    def show_job(job_id: str) -> tuple[Response, int]:
        workflows = weft.ownership.workflows
        record = workflows.get(job_id)
        if record is None:
            return jsonify(error=f"no job {job_id!r}"), 404
        history = json.loads(workflows.load_checkpoint(job_id) or b"[]")
        outcome = workflows.get_outcome(job_id)
        return jsonify(
            id=job_id,
            status=record.status,
            steps=record.input.get("steps") if isinstance(record.input, dict) else None,
            history=history,
            result=None if outcome is None else outcome.result,
        ), 200

    @app.get("/worker")
    def worker() -> Response:
        return jsonify(pid=os.getpid(), counts=jobs_of(app).events.counts())

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.get("/metrics")
    def metrics() -> Response:
        text = serialize_prometheus(weft.ownership.metrics.snapshot())
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")


def shutdown(app: Flask) -> None:
    """Stop the app's job threads, then close its ``Ownership`` (releasing its claims)."""
    jobs_of(app).close()
    weft.close(app)


def self_test(url: str) -> int:
    """Start a job, wait until it completes and print it; 0 when it did."""
    app = create_app({"WEFT_SYNC_URL": url, "JOBS_STEP_MS": 20})
    try:
        client = app.test_client()
        job_id = client.post("/jobs", json={"steps": 3}).get_json()["id"]
        print(f"started {job_id}")
        deadline = time.monotonic() + 10
        job = client.get(f"/jobs/{job_id}").get_json()
        while job["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
            job = client.get(f"/jobs/{job_id}").get_json()
        print(f"{job_id}: {job['status']}, {len(job['history'])} steps, result {job['result']}")
        return 0 if job["status"] == "completed" else 1
    finally:
        shutdown(app)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Flask app whose jobs are weft_sync workflows.")
    parser.add_argument("--url", help="store URL (default: a SQLite file in a temporary dir)")
    parser.add_argument("--self-test", action="store_true", help="run one job, then exit")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weft-flask-") as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'jobs.db'}"
        if args.self_test:
            return self_test(url)
        app = create_app({"WEFT_SYNC_URL": url})
        try:
            app.run()
        finally:
            shutdown(app)
    return 0


if __name__ == "__main__":
    sys.exit(main())
