"""Start and stop a throwaway PostgreSQL cluster for the test suite."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PostgresCluster", "as_server_user", "find_binary", "run_checked", "start_cluster"]


def find_binary(name: str) -> str:
    """The path of the PostgreSQL server program ``name`` (on ``PATH``, else the newest install)."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True):
        return candidate
    raise RuntimeError(f"the PostgreSQL server binary {name!r} is not installed")


def as_server_user(cmd: list[str]) -> list[str]:
    """``cmd``, run as the ``postgres`` user when the suite runs as root (initdb refuses root)."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@dataclass
class PostgresCluster:
    """A running cluster listening only on a Unix socket in ``directory``."""

    directory: Path
    pg_ctl: str

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.directory}"

    def start(self) -> None:
        opts = (
            f"-k {self.directory} -c listen_addresses='' -c fsync=off "
            f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
        )
        cmd = [self.pg_ctl, "-D", str(self.data_dir), "-o", opts]
        cmd += ["-l", str(self.directory / "server.log"), "-w", "-t", "60", "start"]
        run_checked(as_server_user(cmd))

    def stop(self, *, remove: bool = True) -> None:
        cmd = [self.pg_ctl, "-D", str(self.data_dir), "-m", "fast", "-w", "stop"]
        subprocess.run(as_server_user(cmd), capture_output=True, check=False)
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)

    def restart(self) -> None:
        self.stop(remove=False)
        self.start()


def run_checked(cmd: list[str]) -> None:
    """Run ``cmd``; a non-zero exit raises :class:`RuntimeError` with its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def start_cluster() -> PostgresCluster:
    """Create and start a cluster in a fresh temporary directory owned by the server user."""
    initdb = find_binary("initdb")
    pg_ctl = find_binary("pg_ctl")
    directory = Path(tempfile.mkdtemp(prefix="weft-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, user="postgres")
    cluster = PostgresCluster(directory, pg_ctl)
    cmd = [initdb, "-D", str(cluster.data_dir), "-A", "trust", "-U", "postgres", "-E", "UTF8"]
    try:
        run_checked(as_server_user([*cmd, "--no-sync"]))
        cluster.start()
    except Exception:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return cluster
