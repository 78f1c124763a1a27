"""gunicorn ``--preload`` with an import-time ``Ownership.open``: the master drives nothing.

A WSGI app opens an engine with a handler at import (the mistake a pre-fork server punishes)
and, in each worker, another one lazily on its first request. gunicorn imports the app in the
master, then forks two workers: the master's engine stops its maintenance and handlers before
the first fork and says so in the log. A workflow stranded afterwards is driven by a worker's
engine, never by the master.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.examples.gunicorn_harness import run_gunicorn
from tests.examples.helpers import REPO_ROOT
from weft_sync import Ownership, OwnershipOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_APP = """
import os
from weft_sync import Ownership, OwnershipOptions

URL = os.environ["PRELOAD_APP_URL"]
OPTIONS = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)


def handler(ctx):
    ctx.workflows.complete(ctx.workflow_id, {"by": os.getpid()})


EAGER = Ownership.open(URL, options=OPTIONS, handlers={"job": handler})  # at import: the master
_lazy = {}


def app(environ, start_response):
    pid = os.getpid()
    if pid not in _lazy:
        _lazy[pid] = Ownership.open(URL, options=OPTIONS, handlers={"job": handler})
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(pid).encode()]
"""


def test_a_preloaded_master_with_an_import_time_open_drives_nothing(
    storage_url: str, tmp_path: Path
) -> None:
    (tmp_path / "preload_app.py").write_text(_APP)
    env = {
        "PRELOAD_APP_URL": storage_url,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
    }
    options = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)
    with run_gunicorn(
        "preload_app:app",
        log_path=tmp_path / "gunicorn.log",
        workers=2,
        env=env,
        preload=True,
        ready_path="/",
        cwd=tmp_path,
    ) as server:
        for _ in range(6):  # every worker opens its engine on a request
            server.request("GET", "/")
        with Ownership.open(storage_url, options=options, background="manual") as starter:
            starter.workflows.start("wf-1", "job")
            starter.registry.release("wf-1")  # stranded: running, nobody holds it
            deadline = time.monotonic() + 60
            outcome = None
            while time.monotonic() < deadline:
                outcome = starter.workflows.get_outcome("wf-1")
                if outcome is not None:
                    break
                time.sleep(0.1)
            assert outcome is not None, server.log()
            by = outcome.result["by"]
            assert by != server.master_pid
            assert by in server.worker_pids()
        assert "drives no workflow" in server.log()
