"""Where an acquire + release cycle spends its client CPU, layer by layer, on PostgreSQL.

Thread CPU time (``time.thread_time``) per cycle, so the round trips' wait is left out and a
busy machine changes the figures little; the median of the rounds is printed, with the ratio to
the raw floor, and the process CPU (``time.process_time``: the store's other threads, such as
its deadline watcher, included). Three ways of doing the same cycle on ids of its own
per variant, measured round by round in one process against one table:

- ``registry``: ``ClaimRegistry.acquire`` + ``release`` over ``PostgresStorage``;
- ``storage``: the two transactions the registry sends, by hand through the storage API: one
  ``read_then_write`` (holder and epoch read, three puts, the holder required absent) and one
  ``conditional_batch`` (two conditions, two deletes), with the library's key and record
  encoders;
- ``raw``: the benchmark floor of ``bench/acquire_release.py`` (plain psycopg, one autocommit
  connection, the same rows).

It also counts the statements one cycle of each sends (``BEGIN``, ``COMMIT`` and the pool's
empty liveness query included: each is a round trip), from libpq's trace of the connection the
variant runs on (an experiment on the private pool of this process's stores, each of which has
one connection open, as a single caller leaves it).

The server is a throwaway cluster (``tests/pgcluster.py``), restarted with durable commits as
``bench/acquire_release.py`` runs it, unless ``WEFT_SYNC_TEST_POSTGRES_DSN`` names one.

    python bench/pg_cycle_cpu.py [--rounds 9] [--cycles 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acquire_release import RawPostgresContext, RegistryContext
from bench.common import bench_site, machine_note, postgres_settings
from bench.cycle_cpu import storage_cycle
from weft_sync.storage.postgres import PostgresStorage

Cycle = Callable[[], None]


def cpu_per_cycle(cycle: Cycle, cycles: int) -> tuple[float, float]:
    """Thread and process CPU per cycle over ``cycles`` cycles, in microseconds."""
    thread, process = time.thread_time(), time.process_time()
    for _ in range(cycles):
        cycle()
    return (
        (time.thread_time() - thread) / cycles * 1e6,
        (time.process_time() - process) / cycles * 1e6,
    )


def statements_per_cycle(conn: Any, cycle: Cycle, trace: Path, cycles: int = 20) -> float:
    """Statements ``conn`` sent per cycle, from libpq's trace of it (``PQtrace``): each simple
    query (``BEGIN``, ``COMMIT``) and each ``Bind`` of an extended-protocol statement is one."""
    with trace.open("w") as out:
        conn.pgconn.trace(out.fileno())
        try:
            for _ in range(cycles):
                cycle()
        finally:
            conn.pgconn.untrace()
    sent = 0
    for line in trace.read_text().splitlines():
        fields = line.split("\t")
        if "F" in fields[:2] and any(f in ("Query", "Bind") for f in fields[1:4]):
            sent += 1
    return sent / cycles


def _only_connection(store: Any) -> Any:
    """The one connection ``store``'s pool holds (a single caller never needs a second)."""
    pool = store._pool
    if pool.get_stats().get("pool_size") != 1:
        raise RuntimeError(f"{store!r} holds more than one connection")
    conn = pool.getconn()
    pool.putconn(conn)
    return conn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    with bench_site(["postgres"], durable_postgres=True) as site:
        spec = site.new_store("postgres", "pgcycle")
        assert site.pg_url is not None
        registry = RegistryContext(spec)
        raw = RawPostgresContext(spec)
        store = spec.open()
        assert isinstance(store, PostgresStorage)
        variants = {
            "registry": registry.cycle_for(1),
            "storage": storage_cycle(store, "engine-storage"),
            "raw": raw.cycle_for(2),
        }
        try:
            for cycle in variants.values():
                for _ in range(200):
                    cycle()
            print(
                f"PostgreSQL acquire + release client CPU per cycle; {machine_note()}; "
                f"{postgres_settings(site.pg_url)}"
            )
            conns = {
                "registry": _only_connection(registry.storage),
                "storage": _only_connection(store),
                "raw": raw.connections[0],
            }
            trace = Path(site.tmp) / "libpq.trace"
            sent = {
                name: statements_per_cycle(conns[name], cycle, trace)
                for name, cycle in variants.items()
            }
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, cycle in variants.items():
                    results[name].append(cpu_per_cycle(cycle, args.cycles))
            floor = statistics.median(thread for thread, _ in results["raw"])
            print(
                f"{'variant':10s} {'CPU us/cycle':>13s} {'/ raw':>7s} {'process CPU':>12s} "
                f"{'statements':>11s}"
            )
            for name, samples in results.items():
                value = statistics.median(thread for thread, _ in samples)
                process = statistics.median(process for _, process in samples)
                print(
                    f"{name:10s} {value:13.1f} {value / floor:6.2f}x {process:12.1f} "
                    f"{sent[name]:11.1f}"
                )
        finally:
            registry.close()
            raw.close()
            store.close()


if __name__ == "__main__":
    main()
