"""Running the ``weft-sync`` command line in-process and as a real process, and store setups.

Claims are set up through an ``Ownership`` whose ``ManualClock`` sits an hour before or after
the wall clock, so "59 min ago" / "in 60 min" is known to the minute although the CLI reads the
wall clock.
"""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from weft_sync import ManualClock, Ownership, system_clock
from weft_sync.cli.app import main

REPO_ROOT = Path(__file__).resolve().parents[2]
HOUR_MS = 3_600_000
WAIT_S = 20.0
"""Upper bound for waiting on a subprocess; reaching it means the test failed."""

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
"""An ISO-8601 UTC time as the CLI prints it."""


def run_cli(*argv: str) -> tuple[int, str]:
    """Run the CLI in-process; return its exit code and what it wrote to ``out``."""
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout importable, no inherited store URL."""
    env = {k: v for k, v in os.environ.items() if k != "WEFT_SYNC_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def cli_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "weft_sync", *argv]


def run_cli_process(*argv: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m weft_sync ARGV`` to completion."""
    return subprocess.run(
        cli_command(*argv), capture_output=True, text=True, timeout=timeout, env=cli_env()
    )


def assert_one_line_no_traceback(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {stderr!r}"
    assert "Traceback" not in stderr
    assert lines[0].startswith("weft-sync: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def iso(ms: int) -> str:
    """``ms`` as the CLI's ISO-8601 UTC text, computed independently of the CLI."""
    return datetime.fromtimestamp(ms // 1000, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def leave_claim(
    url: str,
    workflow_id: str,
    *,
    offset_ms: int,
    engine_id: str,
    workflow_type: str = "report",
) -> None:
    """Start a running workflow on an engine whose clock is ``offset_ms`` off, then crash it.

    The engine forgets its claim without releasing it, as a killed process would: the holder
    record stays with ``expires_at`` = wall clock + ``offset_ms`` + the 30 s TTL.
    """
    clock = ManualClock(system_clock() + offset_ms)
    with Ownership.open(url, background="manual", clock=clock, engine_id=engine_id) as engine:
        engine.workflows.start(workflow_id, workflow_type, input={"pages": 3})
        engine.registry.forget_local_claim(workflow_id)


def abandon(url: str, workflow_id: str, workflow_type: str = "report") -> None:
    """A running workflow whose engine died an hour ago (its claim is takeover-eligible)."""
    leave_claim(
        url, workflow_id, offset_ms=-HOUR_MS, engine_id="dead-engine", workflow_type=workflow_type
    )


def leave_bare_claim(url: str, workflow_id: str, *, offset_ms: int, engine_id: str) -> None:
    """A bare ``claim()`` (no workflow record) left behind by a crashed process."""
    clock = ManualClock(system_clock() + offset_ms)
    with Ownership.open(url, background="manual", clock=clock, engine_id=engine_id) as engine:
        assert engine.registry.acquire(workflow_id).status == "acquired"
        engine.registry.forget_local_claim(workflow_id)


class OutputReader:
    """Reads a child's stdout (or stderr) with a deadline: a silent child fails, not hangs."""

    def __init__(self, proc: subprocess.Popen[bytes], *, stderr: bool = False) -> None:
        stream = proc.stderr if stderr else proc.stdout
        assert stream is not None
        self._fd = stream.fileno()
        self.text = ""

    def wait_for(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + WAIT_S
        while True:
            match = re.search(pattern, self.text)
            if match is not None:
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {pattern!r} in the output so far: {self.text!r}")
            ready, _, _ = select.select([self._fd], [], [], remaining)
            if ready:
                chunk = os.read(self._fd, 4096)
                if not chunk:
                    raise AssertionError(f"output ended without {pattern!r}: {self.text!r}")
                self.text += chunk.decode()
