"""A throwaway Redis server for the benchmarks that compare against Redis locks.

:func:`start_redis` runs Debian's ``redis-server`` as a subprocess listening only on a Unix socket
in a directory of the benchmark's, with durable settings: ``appendonly yes`` and
``appendfsync always`` (every write command is fsynced to the append-only file before it is
acknowledged) and no RDB snapshots (``save ''``). :func:`redis_missing` says why the Redis
contenders cannot run here (no server binary, or no ``redis`` / ``redis_lock`` package).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVER_BINARY = "redis-server"
DURABLE_SETTINGS = ("--appendonly", "yes", "--appendfsync", "always", "--save", "")
REPORTED_SETTINGS = ("appendonly", "appendfsync", "save")
START_TIMEOUT_S = 20.0


def redis_missing() -> str | None:
    """Why the Redis contenders cannot run on this machine, or ``None`` when they can."""
    missing = []
    if shutil.which(SERVER_BINARY) is None:
        missing.append(f"no {SERVER_BINARY} binary (Debian package redis-server)")
    if importlib.util.find_spec("redis") is None:
        missing.append("no redis module (pip package redis)")
    if importlib.util.find_spec("redis_lock") is None:
        missing.append("no redis_lock module (pip package python-redis-lock)")
    return "; ".join(missing) or None


@dataclass(frozen=True)
class RedisServer:
    """A running server: where to reach it and what it reports about itself."""

    socket: str
    version: str
    settings: str

    def client(self, **kwargs: Any) -> Any:
        """A new ``redis.Redis`` client (with its own connection pool) on the server's socket."""
        import redis

        return redis.Redis(unix_socket_path=self.socket, **kwargs)

    @property
    def note(self) -> str:
        return f"redis-server {self.version} on a Unix socket, {self.settings}"


@contextmanager
def start_redis(directory: Path) -> Iterator[RedisServer]:
    """Run ``redis-server`` with its socket, append-only file and log in ``directory``.

    Stops it (and waits for it to exit) when the block ends.

    :raises RuntimeError: the server did not answer ``PING`` within :data:`START_TIMEOUT_S`.
    """
    import redis

    directory.mkdir(parents=True, exist_ok=True)
    socket = str(directory / "redis.sock")
    cmd = [
        SERVER_BINARY,
        "--port",
        "0",
        "--unixsocket",
        socket,
        "--unixsocketperm",
        "700",
        "--dir",
        str(directory),
        "--daemonize",
        "no",
        "--logfile",
        str(directory / "redis.log"),
        *DURABLE_SETTINGS,
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(unix_socket_path=socket)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{SERVER_BINARY} exited with {proc.returncode}; see its log")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{SERVER_BINARY} did not answer in time") from None
                time.sleep(0.05)
        version = str(client.info("server")["redis_version"])
        config: dict[str, str] = {}
        for name in REPORTED_SETTINGS:
            for key, value in client.config_get(name).items():
                config[_text(key)] = _text(value)
        client.close()
        settings = ", ".join(f"{name}={config.get(name, '?')!r}" for name in REPORTED_SETTINGS)
        yield RedisServer(socket, version, settings)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
