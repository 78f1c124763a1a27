"""Test side of :mod:`tests.liveness.holder`: spawn a holder, wait for a probe to change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
"""Upper bound for a child to start, or for a probe to see a change (never a timing claim)."""
POLL_S = 0.01
"""How often a probe looks for that change."""


@dataclass
class Holder:
    """A running holder process."""

    proc: subprocess.Popen[str]
    line: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)


@contextmanager
def holding(url: str, name: str, mode: str = "lock") -> Iterator[Holder]:
    """Run a holder of ``name`` on ``url``; killed (SIGKILL, after SIGCONT) and reaped on exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.liveness.holder", url, name, mode],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("ready"):
            proc.kill()
            _, err = proc.communicate(timeout=WAIT_S)
            raise AssertionError(f"the holder did not start: {line!r}\n{err}")
        yield Holder(proc, line)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.communicate(timeout=WAIT_S)


def reap(pid: int) -> None:
    """Kill and reap a grandchild (not our child: just kill it and wait for it to vanish)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return

    def gone() -> bool:
        # A zombie (not yet reaped by its new parent) has closed every descriptor: gone enough.
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, f"process {pid} is gone", timeout_s=WAIT_S, poll_s=POLL_S)
