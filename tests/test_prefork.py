"""A pre-fork master drives nothing: an engine opened before a fork stops its background work.

The scenario of gunicorn ``--preload`` with an import-time ``Ownership.open``, in a real process:
the "master" opens an engine with handlers and forks a "worker", which opens its own engine
lazily. A workflow stranded after the fork is driven by the worker, never by the master, whose
maintenance, crash probe and handler threads stopped before the fork (with a warning saying why).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_MASTER = """
import os, sys, threading, time
from weft_sync import Ownership, OwnershipOptions

url = sys.argv[1]
options = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)

def handler(ctx):
    ctx.workflows.complete(ctx.workflow_id, {"by": os.getpid()})

master = Ownership.open(url, options=options, handlers={"job": handler})  # at "import"
starter = Ownership.open(url, options=options, background="manual")
pid = os.fork()
if pid == 0:
    worker = Ownership.open(url, options=options, handlers={"job": handler})  # lazily
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        record = worker.workflows.get("wf-1")
        if record is not None and record.status == "completed":
            break
        time.sleep(0.05)
    worker.close()
    os._exit(0)
# Stranded after the fork: running, nobody holds it.
starter.workflows.start("wf-1", "job")
starter.registry.release("wf-1")
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
outcome = master.workflows.get_outcome("wf-1")
ours = ("weft-timer", "weft-handler", "weft-liveness")
names = sorted(t.name for t in threading.enumerate() if t.name.startswith(ours))
print(outcome is not None and outcome.result["by"] == pid, master.started, names)
master.close()
starter.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_engine_opened_before_a_fork_drives_nothing_in_the_forking_process(
    storage_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "master.py"
    script.write_text(_MASTER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore::DeprecationWarning")
    done = subprocess.run(
        [sys.executable, str(script), storage_url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "True False []"
    assert "drives no workflow" in done.stderr and "Open the Ownership lazily" in done.stderr


def test_on_fork_continue_keeps_the_engine_running() -> None:
    from weft_sync import OwnershipOptions

    assert OwnershipOptions(on_fork="continue").on_fork == "continue"
    with pytest.raises(ValueError, match="on_fork must be 'stop' or 'continue'"):
        OwnershipOptions(on_fork="pause")  # type: ignore[arg-type]
