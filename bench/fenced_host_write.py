"""Time a fenced one-row UPDATE against the same UPDATE unfenced, on the same connection.

For each backend, one store and one host table ``(id, v)`` share a database: a SQLite file (WAL,
``synchronous=FULL`` on both connections) or a PostgreSQL database. Each round runs ``--ops``
transactions of one ``UPDATE … WHERE id = ?`` each way, the ways taking turns every ``--chunk``
transactions:

- ``unfenced``: the host's own transaction (``BEGIN IMMEDIATE`` … ``COMMIT`` on SQLite,
  ``connection.transaction()`` on psycopg);
- ``fenced``: the same statement inside ``ownership.fenced(workflow_id, connection)``;
- ``hand-written``: the unfenced transaction plus the one epoch read the fence adds, written by
  hand (``SELECT … FOR SHARE`` on PostgreSQL), the floor for any fence of this kind. psycopg 3
  prepares it in the session after ``prepare_threshold`` (5) runs, as it does any query it
  sees that often;
- ``unprepared`` (PostgreSQL only): the same with ``prepare=False``, the floor for a fence that
  may leave no prepared statement in the host's session (the server parses and plans the
  read in every transaction).
- ``by hand`` (PostgreSQL only): the fence's own statements written out, unprepared: its epoch
  read (which also sets the transaction's ``lock_timeout``, idle timeout and mark) in
  psycopg's implicit transaction, the ``UPDATE``, then the mark's check with the ``COMMIT``
  in one simple query. Its ratio to ``unfenced`` is what this fence's design costs before
  any of the library's Python runs; fenced / by hand is that Python.

Prints the median per-transaction time of each (over all chunks) and the ratios fenced /
unfenced, fenced / hand-written, unprepared / unfenced, by hand / unfenced and fenced / by hand
measured in this run. The fence adds
three statements on SQLite (the re-check of the same-database proof, ``PRAGMA database_list``,
the epoch read, and the end check, which reads the epoch again just before ``COMMIT``) and one
round trip on psycopg 3 (the epoch read, never prepared, between psycopg's ``BEGIN`` and the
host's ``UPDATE``; the end check goes with the ``COMMIT``, one simple query).
``postgres`` uses ``WEFT_SYNC_TEST_POSTGRES_DSN`` when set, else a throwaway cluster; both the
test clusters run with ``fsync=off``, where commits are nearly free. ``postgres-durable`` starts
a throwaway cluster of its own with ``fsync=on`` and ``synchronous_commit=on``, as production
runs.

    python bench/fenced_host_write.py [--ops 200] [--rounds 7] [--chunk 10]
        [--backend sqlite|postgres|postgres-durable]

``--rounds 2`` is a quick look (about 10 s a backend); compare ratios, not times, between runs.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from tests.pgcluster import PostgresCluster, start_cluster
from weft_sync import Ownership, keys
from weft_sync.storage.fence_proof import PG_COMMIT_CHECKED, PG_READ_EPOCH
from weft_sync.storage.sqlite.identity import DIR_STAMP_MARGIN_NS

WID = "bench-fenced"


class _DurableCluster(PostgresCluster):
    """A throwaway cluster that flushes every commit to disk."""

    def start(self) -> None:
        opts = f"-k {self.directory} -c listen_addresses='' -c fsync=on -c synchronous_commit=on"
        cmd = [self.pg_ctl, "-D", str(self.data_dir), "-o", opts]
        cmd += ["-l", str(self.directory / "server.log"), "-w", "-t", "60", "start"]
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd, check=True
        )


@contextmanager
def _pg_url(durable: bool) -> Iterator[str]:
    env = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
    if env and not durable:
        yield env
        return
    cluster = start_cluster()
    if durable:
        cluster.stop(remove=False)
        cluster = _DurableCluster(cluster.directory, cluster.pg_ctl)
        cluster.start()
    try:
        yield cluster.url
    finally:
        cluster.stop()


def _time_ops(start_i: int, ops: int, one: Callable[[int], None]) -> float:
    start = time.perf_counter()
    for i in range(start_i, start_i + ops):
        one(i)
    return (time.perf_counter() - start) / ops


def _measure(ops: int, rounds: int, chunk: int, *ways: Callable[[int], None]) -> list[float]:
    """Median per-transaction time of each way, over chunks of ``chunk`` transactions.

    The ways take turns every ``chunk`` transactions, so a disk or a neighbour whose speed
    drifts during the run slows all of them alike instead of whichever ran at that moment.
    """
    for way in ways:
        way(0)  # warm up: connection set-up and the same-database proof
    samples: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for start_i in range(0, ops, chunk):
            for way, sample in zip(ways, samples, strict=True):
                sample.append(_time_ops(start_i, min(chunk, ops - start_i), way))
    return [statistics.median(sample) for sample in samples]


def bench_sqlite(ops: int, rounds: int, chunk: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        with Ownership.open(f"sqlite:///{path}", background="manual") as own:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("CREATE TABLE host (id TEXT PRIMARY KEY, v INTEGER)")
            conn.execute("INSERT INTO host VALUES ('row', 0)")
            own.registry.acquire(WID)
            epoch_key = keys.workflow_owner_epoch(WID)
            sql = "UPDATE host SET v = ? WHERE id = 'row'"
            # As in a long-running host, the store's directory has settled (no file created in
            # it for DIR_STAMP_MARGIN_NS), so the store's identity check, which every fenced
            # block runs before its commit, stats the database file and the directory only.
            time.sleep(DIR_STAMP_MARGIN_NS / 1e9 + 0.2)

            def unfenced(i: int) -> None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(sql, (i,))
                conn.execute("COMMIT")

            def fenced(i: int) -> None:
                with own.fenced(WID, conn):
                    conn.execute(sql, (i,))

            def floor(i: int) -> None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("SELECT value FROM weft_kv WHERE key = ?", (epoch_key,)).fetchall()
                conn.execute(sql, (i,))
                conn.execute("COMMIT")

            try:
                return _measure(ops, rounds, chunk, unfenced, fenced, floor)
            finally:
                conn.close()


def bench_postgres(ops: int, rounds: int, chunk: int, durable: bool = False) -> list[float]:
    with _pg_url(durable) as base:
        suffix = uuid.uuid4().hex[:10]
        host = f"bench_host_{suffix}"
        store = f"bench_kv_{suffix}"
        sep = "&" if "?" in base else "?"
        try:
            with Ownership.open(f"{base}{sep}table={store}", background="manual") as own:
                return _postgres_ways(own, base, host, store, ops, rounds, chunk)
        finally:
            with psycopg.connect(base, autocommit=True) as admin:
                admin.execute(f"DROP TABLE IF EXISTS {store}")


def _postgres_ways(
    own: Ownership, base: str, host: str, store: str, ops: int, rounds: int, chunk: int
) -> list[float]:
    conn: psycopg.Connection[Any] = psycopg.connect(base)
    try:
        with conn.transaction():
            conn.execute(f"CREATE TABLE {host} (id TEXT PRIMARY KEY, v INTEGER)")
            conn.execute(f"INSERT INTO {host} VALUES ('row', 0)")
        own.registry.acquire(WID)
        epoch_key = keys.workflow_owner_epoch(WID)
        sql = f"UPDATE {host} SET v = %s WHERE id = 'row'"
        lock = f"SELECT value FROM {store} WHERE key = %s FOR SHARE"

        def unfenced(i: int) -> None:
            with conn.transaction():
                conn.execute(sql, [i])

        def fenced(i: int) -> None:
            with own.fenced(WID, conn):
                conn.execute(sql, [i])

        def floor(i: int) -> None:
            with conn.transaction():
                conn.execute(lock, [epoch_key]).fetchall()
                conn.execute(sql, [i])

        def unprepared(i: int) -> None:
            with conn.transaction():
                conn.execute(lock, [epoch_key], prepare=False).fetchall()
                conn.execute(sql, [i])

        # The fence's own statements, by hand: its epoch read (with its transaction's settings)
        # in psycopg's implicit transaction, the host's UPDATE, the check with the COMMIT.
        read = PG_READ_EPOCH.format(table=store)
        settings = ["5000ms", "10000ms"]

        def by_hand(i: int) -> None:
            conn.execute(read, [epoch_key, *settings], prepare=False).fetchall()
            conn.execute(sql, [i])
            conn.execute(PG_COMMIT_CHECKED)

        return _measure(ops, rounds, chunk, unfenced, fenced, floor, unprepared, by_hand)
    finally:
        with conn.transaction():
            conn.execute(f"DROP TABLE IF EXISTS {host}")
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=10, help="transactions per turn of each way")
    parser.add_argument(
        "--backend", choices=("sqlite", "postgres", "postgres-durable"), action="append"
    )
    args = parser.parse_args()
    for backend in args.backend or ["sqlite", "postgres", "postgres-durable"]:
        unprepared = by_hand = None
        if backend == "sqlite":
            plain, guarded, floor = bench_sqlite(args.ops, args.rounds, args.chunk)
        else:
            plain, guarded, floor, unprepared, by_hand = bench_postgres(
                args.ops, args.rounds, args.chunk, backend.endswith("durable")
            )
        line = (
            f"{backend:16s} unfenced {plain * 1e6:7.0f} us  fenced {guarded * 1e6:7.0f} us  "
            f"hand-written read+update {floor * 1e6:7.0f} us"
        )
        if unprepared is not None:
            line += f" (unprepared {unprepared * 1e6:.0f} us)"
        line += (
            f"  fenced/unfenced {guarded / plain:.2f}x  fenced/hand-written {guarded / floor:.2f}x"
        )
        if unprepared is not None:
            line += f"  unprepared/unfenced {unprepared / plain:.2f}x"
        if by_hand is not None:
            line += (
                f"  the fence's statements by hand/unfenced {by_hand / plain:.2f}x"
                f"  fenced/by hand {guarded / by_hand:.2f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
