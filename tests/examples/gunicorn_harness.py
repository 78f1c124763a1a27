"""Run a WSGI app under a real gunicorn: find its workers, signal them, read its log, clean up.

Usage::

    with run_gunicorn("examples.flask_app.app:create_app()", workers=4, env={...}) as server:
        status, body = server.request("POST", "/jobs", {"steps": 3})
        pids = server.worker_pids()
        server.signal(pids[0], signal.SIGKILL)

gunicorn binds port 0 of 127.0.0.1 and the harness reads the port it got from its log, so
parallel runs never race for a port. The server runs in its own session; on exit every worker
that was stopped is continued, the master gets SIGTERM, and whatever is left of the process
group is killed, so no test leaves a process behind. :func:`exception_lines` reads the
tracebacks the app logged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from tests.examples.helpers import REPO_ROOT, script_env

STARTUP_S = 30.0
STOP_S = 15.0
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")
_TRACEBACK = "Traceback (most recent call last):"


class GunicornError(AssertionError):
    """gunicorn did not start, or did not do what a test asked; carries its log."""


class GunicornServer:
    """A running gunicorn master, its port and its log."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        self.port = 0
        self.stopped: set[int] = set()

    @property
    def master_pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float = 10.0
    ) -> tuple[int, Any]:
        """Send one HTTP request; return the status and the decoded JSON body (or text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data, method=method)
        if data is not None:
            req.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, _decode(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())

    def worker_pids(self) -> list[int]:
        """The pids of the master's live worker processes, ascending."""
        return sorted(pid for pid in _children(self.master_pid) if alive(pid))

    def wait_for_workers(
        self, count: int, *, exclude: Sequence[int] = (), timeout: float = 30.0
    ) -> list[int]:
        """Wait until ``count`` workers not in ``exclude`` run; return their pids."""
        deadline = time.monotonic() + timeout
        while True:
            pids = [p for p in self.worker_pids() if p not in exclude]
            if len(pids) >= count:
                return pids
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise GunicornError(f"expected {count} workers, have {pids}\n{self.log()}")
            time.sleep(0.05)

    def signal(self, pid: int, sig: signal.Signals) -> None:
        """Send ``sig`` to one of this server's workers."""
        if pid not in _children(self.master_pid):
            raise GunicornError(f"{pid} is not a worker of gunicorn {self.master_pid}")
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(pid)

    def stop_outside(self, pid: int, is_busy: Callable[[int], bool]) -> int:
        """SIGSTOP ``pid`` at a moment ``is_busy(pid)`` says it is not inside a critical section.

        A process stopped while it holds a lock others need stalls them as well; a test of a
        paused worker usually wants it paused between writes. Returns how many stops it took.
        """
        return self.stop_when(pid, lambda p: not is_busy(p))

    def stop_when(self, pid: int, accept: Callable[[int], bool], *, attempts: int = 200) -> int:
        """SIGSTOP ``pid``, continuing and retrying until ``accept(pid)`` holds while it is stopped.

        Returns how many stops it took.
        """
        return self.stop_one_when(lambda: pid, accept, attempts=attempts)[1]

    def stop_one_when(
        self,
        choose: Callable[[], int | None],
        accept: Callable[[int], bool],
        *,
        attempts: int = 200,
    ) -> tuple[int, int]:
        """SIGSTOP the worker ``choose()`` names, continuing it and choosing again until
        ``accept(pid)`` holds while it is stopped (``None``: no worker fits now, wait a moment).

        Returns the stopped pid and how many tries it took.
        """
        last: int | None = None
        for attempt in range(1, attempts + 1):
            pid = choose()
            if pid is not None:
                last = pid
                self.signal(pid, signal.SIGSTOP)
                _wait_stopped(pid)
                if accept(pid):
                    return pid, attempt
                self.signal(pid, signal.SIGCONT)
            time.sleep(0.003 * (attempt % 7 + 1))
        raise GunicornError(
            f"no worker was stopped in the wanted state in {attempts} tries (last chosen: {last})"
        )

    def close(self) -> None:
        """Continue stopped workers, stop the master, kill whatever is left; idempotent."""
        for pid in list(self.stopped):
            _kill_quietly(pid, signal.SIGCONT)
        self.stopped.clear()
        if self.process.poll() is None:
            _kill_quietly(self.master_pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_S)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.master_pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(STOP_S)


@contextmanager
def run_gunicorn(
    app_spec: str,
    *,
    log_path: Path,
    workers: int = 4,
    env: Mapping[str, str] | None = None,
    preload: bool = False,
    extra_args: Sequence[str] = (),
    ready_path: str = "/healthz",
    cwd: Path = REPO_ROOT,
) -> Iterator[GunicornServer]:
    """Start gunicorn serving ``app_spec`` and yield it once it answers ``ready_path``."""
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        "127.0.0.1:0",
        "--workers",
        str(workers),
        "--graceful-timeout",
        "5",
        # The master kills a worker silent for this long: well past what a test pauses a worker
        # (or stalls the others behind it) for on a loaded machine, where 30 s (the default)
        # was reached and the worker the test meant to signal was replaced.
        "--timeout",
        "300",
        "--error-logfile",
        "-",
        *(["--preload"] if preload else []),
        *extra_args,
        app_spec,
    ]
    full_env = {**script_env(), **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = GunicornServer(process, log_path)
    try:
        server.port = _wait_for_port(server)
        _wait_ready(server, ready_path)
        server.wait_for_workers(workers)
        yield server
    finally:
        server.close()


def _wait_for_port(server: GunicornServer) -> int:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        match = _LISTENING.search(server.log())
        if match:
            return int(match.group(1))
        if server.process.poll() is not None:
            break
        time.sleep(0.05)
    raise GunicornError(f"gunicorn did not start listening:\n{server.log()}")


def _wait_ready(server: GunicornServer, path: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    last: object = None
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            status, _ = server.request("GET", path, timeout=2.0)
            if status == 200:
                return
            last = status
        except OSError as exc:
            last = exc
        time.sleep(0.05)
    raise GunicornError(f"gunicorn never answered {path} (last: {last!r}):\n{server.log()}")


def exception_lines(log: str) -> list[str]:
    """The final line (the exception) of each traceback in a gunicorn ``log``."""
    lines = log.splitlines()
    found = []
    for n, line in enumerate(lines):
        if line.strip() != _TRACEBACK:
            continue
        rest = (later for later in lines[n + 1 :] if later and not later.startswith((" ", "\t")))
        found.append(next(rest, "<traceback cut off>"))
    return found


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ")".
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def _state(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "X"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a gone process does not)."""
    return _state(pid) not in ("Z", "X")


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(pid) not in ("T", "t"):
        if time.monotonic() > deadline:
            raise GunicornError(f"worker {pid} did not stop (state {_state(pid)})")
        time.sleep(0.002)


def _kill_quietly(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


def write_locks_held(pid: int) -> list[str]:
    """The ``/proc/locks`` lines of write locks (flock or fcntl) that ``pid`` holds.

    The engine's session lock (an ``flock`` it holds on a file in ``<db>.weft-locks/`` for as
    long as it lives) is left out: only the locks of a write in progress count.
    """
    session_inodes = _session_lock_inodes(pid)
    held = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; blocked waiters are "->" lines.
        live = len(fields) >= 6 and fields[1] != "->"
        mine = live and fields[3] == "WRITE" and fields[4] == str(pid)
        if mine and fields[5].rsplit(":", 1)[-1] not in session_inodes:
            held.append(line)
    return held


def _session_lock_inodes(pid: int) -> set[str]:
    """The inodes of the session-lock files ``pid`` has open."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            if ".weft-locks" in os.readlink(fd):
                inodes.add(str(fd.stat().st_ino))
        except OSError:
            continue  # closed meanwhile
    return inodes
