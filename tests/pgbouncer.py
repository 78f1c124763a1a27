"""A throwaway pgbouncer in transaction mode in front of a test cluster, on a Unix socket.

Debian's ``pgbouncer`` package provides the binary. It listens only on a socket in a fresh
temporary directory and forwards database ``postgres`` to the cluster named by its URL, with
``ignore_startup_parameters = options`` as deployments that let libpq clients in do (the
``options`` a client sends are then dropped, not applied).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from tests.pgcluster import as_server_user

__all__ = ["pgbouncer_binary", "transaction_pooler"]

_START_S = 30.0


def pgbouncer_binary() -> str | None:
    """The pgbouncer binary, or ``None`` when it is not installed."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


def _server_socket_dir(url: str) -> str:
    host = parse_qs(urlsplit(url).query).get("host", [""])[0]
    if not host.startswith("/"):
        raise ValueError(f"the pgbouncer fixture needs a cluster on a Unix socket, got {url!r}")
    return host


@contextmanager
def transaction_pooler(server_url: str) -> Iterator[str]:
    """Run pgbouncer (transaction mode) in front of ``server_url``; yield the URL to use."""
    binary = pgbouncer_binary()
    assert binary is not None
    directory = Path(tempfile.mkdtemp(prefix="weft-pgbouncer-"))
    directory.chmod(0o777)  # written by the server user, which pgbouncer runs as
    port = random.randint(20_000, 40_000)
    (directory / "users.txt").write_text('"postgres" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"postgres = host={_server_socket_dir(server_url)} dbname=postgres user=postgres\n"
        "[pgbouncer]\n"
        "listen_addr =\n"
        f"listen_port = {port}\n"
        f"unix_socket_dir = {directory}\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "ignore_startup_parameters = options\n"
        "max_client_conn = 200\n"
        "default_pool_size = 20\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        f"pidfile = {directory / 'pgbouncer.pid'}\n"
    )
    proc = subprocess.Popen(
        as_server_user([binary, str(directory / "pgbouncer.ini")]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + _START_S
        while not (directory / f".s.PGSQL.{port}").exists():
            if proc.poll() is not None:
                log = directory / "pgbouncer.log"
                error = log.read_text() if log.exists() else ""
                raise RuntimeError(f"pgbouncer did not start: {error[-2000:]}")
            assert time.monotonic() < deadline, "pgbouncer never opened its socket"
            time.sleep(0.05)
        yield f"postgresql://postgres@/postgres?host={directory}&port={port}"
    finally:
        pidfile = directory / "pgbouncer.pid"
        if proc.poll() is None and pidfile.exists():
            # The pgbouncer this fixture started (runuser's child): SIGINT, its quick shutdown.
            os.kill(int(pidfile.read_text().strip()), signal.SIGINT)
        if proc.poll() is None:
            try:
                proc.wait(_START_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_START_S)
        shutil.rmtree(directory, ignore_errors=True)
