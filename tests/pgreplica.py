"""A PostgreSQL primary and a streaming standby, for failover tests and ``bench/failover.py``.

Both clusters run from the same server binaries as the suite's (``tests/pgcluster.py``), listen
only on Unix sockets in their own directories, and run as ``postgres`` (through ``runuser`` when
the suite runs as root). The standby is made with ``pg_basebackup -R`` and streams from the
primary, asynchronously or as the primary's one synchronous standby. Clients connect through
``vip``, a directory symlink standing for a virtual IP: :meth:`ReplicaPair.fail_over` kills the
primary (``-m immediate``), promotes the standby and points ``vip`` at it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.pgcluster import PostgresCluster, as_server_user, find_binary, run_checked

__all__ = ["ReplicaPair", "start_pair"]

_STANDBY_NAME = "weft_standby"


@dataclass
class _Node(PostgresCluster):
    """A cluster started with the settings replication needs (durable commits)."""

    synchronous: bool = False

    def start(self) -> None:
        opts = (
            f"-k {self.directory} -c listen_addresses='' -c fsync=off -c full_page_writes=off "
            f"-c max_connections=100 -c wal_level=replica -c max_wal_senders=5 "
            f"-c hot_standby=on -c wal_receiver_status_interval=1"
        )
        if self.synchronous:
            opts += f" -c synchronous_standby_names={_STANDBY_NAME} -c synchronous_commit=on"
        cmd = [self.pg_ctl, "-D", str(self.data_dir), "-o", opts]
        cmd += ["-l", str(self.directory / "server.log"), "-w", "-t", "60", "start"]
        run_checked(as_server_user(cmd))


@dataclass
class ReplicaPair:
    """A running primary and standby; ``url`` reaches whichever is primary now (via ``vip``)."""

    root: Path
    primary: _Node
    standby: _Node

    @property
    def vip(self) -> Path:
        return self.root / "vip"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.vip}"

    def node_url(self, node: PostgresCluster) -> str:
        return f"postgresql://postgres@/postgres?host={node.directory}"

    def wait_replayed(self, timeout_s: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary has written."""
        import psycopg

        with psycopg.connect(self.node_url(self.primary), autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout_s
        with psycopg.connect(self.node_url(self.standby), autocommit=True) as conn:
            while True:
                done = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
                if done is not None and done[0]:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the standby did not replay up to {target}")
                time.sleep(0.05)

    def stop_standby(self) -> None:
        """Stop the standby (it falls behind: what the primary commits now it never gets)."""
        self.standby.stop(remove=False)

    def fail_over(self, *, restart_standby: bool = False, move_vip: bool = True) -> None:
        """Kill the primary, promote the standby (started first if stopped), move ``vip``
        (or leave that to :meth:`move_vip`)."""
        cmd = [self.primary.pg_ctl, "-D", str(self.primary.data_dir), "-m", "immediate", "stop"]
        subprocess.run(as_server_user(cmd), capture_output=True, check=False)
        if restart_standby:
            self.standby.start()
        promote = [self.standby.pg_ctl, "-D", str(self.standby.data_dir), "-w", "promote"]
        run_checked(as_server_user(promote))
        if move_vip:
            self.move_vip()

    def move_vip(self) -> None:
        """Point ``vip`` at the standby (the promoted one)."""
        tmp = self.root / "vip.new"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.standby.directory)
        os.replace(tmp, self.vip)

    def stop(self) -> None:
        for node in (self.standby, self.primary):
            node.stop(remove=False)
        shutil.rmtree(self.root, ignore_errors=True)


def start_pair(*, synchronous: bool) -> ReplicaPair:
    """Start a primary, clone it with ``pg_basebackup -R`` and start the clone as its standby."""
    initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
    basebackup = str(Path(initdb).resolve().with_name("pg_basebackup"))
    root = Path(tempfile.mkdtemp(prefix="weft-repl-"))
    dirs = [root / "primary", root / "standby"]
    for d in (root, *dirs):
        d.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(d, user="postgres")
    primary = _Node(dirs[0], pg_ctl, synchronous=synchronous)
    standby = _Node(dirs[1], pg_ctl)
    pair = ReplicaPair(root, primary, standby)
    try:
        init = [initdb, "-D", str(primary.data_dir), "-A", "trust", "-U", "postgres", "-E"]
        run_checked(as_server_user([*init, "UTF8", "--no-sync"]))
        primary.start()
        clone = [basebackup, "-D", str(standby.data_dir), "-h", str(primary.directory)]
        run_checked(as_server_user([*clone, "-U", "postgres", "-R", "-X", "stream", "--no-sync"]))
        conninfo = (
            f"primary_conninfo = 'host={primary.directory} user=postgres "
            f"application_name={_STANDBY_NAME}'\n"
        )
        auto = standby.data_dir / "postgresql.auto.conf"
        with open(auto, "a", encoding="utf-8") as conf:
            conf.write(conninfo)
        standby.start()
        pair.vip.symlink_to(primary.directory)
        pair.wait_replayed()
    except Exception:
        pair.stop()
        raise
    return pair
