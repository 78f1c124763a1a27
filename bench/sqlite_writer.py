"""Time 16 threads doing CAS increments on distinct keys in SQLite: group commit vs. one lock each.

Every thread increments its own key ``--increments`` times by reading it and writing the next
value under a condition on the current bytes, through:

- ``group``: one shared ``SqliteStorage``, whose writer thread commits queued requests together;
- ``serial``: the same storage driven by one thread doing all the increments in turn;
- ``raw``: a plain ``sqlite3`` connection per thread, one ``BEGIN IMMEDIATE`` transaction per
  increment, contending on SQLite's busy handler (what a backend without a writer thread does).

All use WAL and the same ``synchronous`` mode. Prints throughput, median and worst wait per
increment for each, and the ratios measured in this run.

    python bench/sqlite_writer.py [--threads 16] [--increments 200] [--synchronous FULL]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weft_sync.storage import Condition, Delete, Put, SqliteStorage

Increment = Callable[[str, int], None]


def _run(threads: int, increments: int, make_worker: Callable[[], Increment]) -> list[float]:
    """Run ``threads`` workers, each doing ``increments`` increments; return every wait (s)."""
    waits: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            increment = make_worker()
            start.wait()
            for n in range(increments):
                began = time.perf_counter()
                increment(f"k{i:03d}", n)
                waits[i].append(time.perf_counter() - began)
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    workers = [threading.Thread(target=body, args=(i,), name=f"bench-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return [w for per_thread in waits for w in per_thread]


def _storage_increment(store: SqliteStorage) -> Increment:
    def increment(key: str, n: int) -> None:
        current = None if n == 0 else str(n - 1).encode()
        if not store.conditional_batch([Condition(key, current)], [Put(key, str(n).encode())]):
            raise AssertionError(f"increment {n} of {key} lost its CAS")

    return increment


def _raw_increment(path: Path, synchronous: str) -> Increment:
    conn = sqlite3.connect(path, isolation_level=None, timeout=60, check_same_thread=False)
    conn.execute(f"PRAGMA synchronous = {synchronous}")

    def increment(key: str, n: int) -> None:
        current = None if n == 0 else str(n - 1).encode()
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute('SELECT value FROM "bench" WHERE key = ?', (key,)).fetchone()
        if (None if row is None else bytes(row[0])) != current:
            conn.execute("ROLLBACK")
            raise AssertionError(f"increment {n} of {key} lost its CAS")
        conn.execute('REPLACE INTO "bench" (key, value) VALUES (?, ?)', (key, str(n).encode()))
        conn.execute("COMMIT")

    return increment


def _clear(store: SqliteStorage) -> None:
    store.batch([Delete(key) for key, _ in store.scan()])


def _measure(
    name: str, threads: int, increments: int, make_worker: Callable[[], Increment]
) -> tuple[float, float]:
    """Run one variant and print it; return (increments per second, worst wait in seconds)."""
    began = time.perf_counter()
    waits = _run(threads, increments, make_worker)
    elapsed = time.perf_counter() - began
    rate = len(waits) / elapsed
    print(
        f"{name:>6}: {len(waits):6d} increments in {elapsed:6.2f} s = {rate:8.0f}/s, "
        f"median wait {statistics.median(waits) * 1000:7.2f} ms, "
        f"worst {max(waits) * 1000:8.2f} ms"
    )
    return rate, max(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--increments", type=int, default=200)
    parser.add_argument("--synchronous", default="FULL", choices=("FULL", "NORMAL"))
    args = parser.parse_args()
    threads, increments = args.threads, args.increments

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        with SqliteStorage(db, table="bench", synchronous=args.synchronous) as store:
            group, group_worst = _measure(
                "group", threads, increments, lambda: _storage_increment(store)
            )
            _clear(store)
            serial, _ = _measure(
                "serial", 1, threads * increments, lambda: _storage_increment(store)
            )
            _clear(store)
        raw, raw_worst = _measure(
            "raw", threads, increments, lambda: _raw_increment(db, args.synchronous)
        )
    print(f"throughput group/serial: {group / serial:.2f}x, group/raw: {group / raw:.2f}x")
    print(f"worst wait raw/group:    {raw_worst / group_worst:.2f}x")


if __name__ == "__main__":
    main()
