"""Time renewing 10,000 claims on PostgreSQL: the fast path, the general path and a raw floor.

Every run renews every key once (compare the current bytes, write new ones) through:

- ``fast``: ``PostgresStorage.conditional_batches`` with renewal-shaped batches, which run as one
  ``UPDATE … FROM unnest(…)``;
- ``general``: the same batches plus one empty batch, which forces the general path (one
  transaction, a row-locking SELECT and an upsert per batch);
- ``raw``: one hand-written ``UPDATE … FROM unnest(…)`` on a plain psycopg connection, the floor.

Uses ``WEFT_SYNC_TEST_POSTGRES_DSN`` when set, otherwise starts a throwaway cluster (as the tests
do). Prints the median of each path over ``--runs`` runs and the ratios measured in this run.

    python bench/pg_renewal.py [--keys 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from tests.pgcluster import start_cluster
from weft_sync.storage import Condition, Operation, Put
from weft_sync.storage.postgres.store import PostgresStorage

Batches = list[tuple[list[Condition], list[Operation]]]


@contextmanager
def _server_url() -> Iterator[str]:
    env = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
    if env:
        yield env
        return
    cluster = start_cluster()
    try:
        yield cluster.url
    finally:
        cluster.stop()


class _Keys:
    """The keys under test and the bytes each one holds now."""

    def __init__(self, count: int) -> None:
        self.keys = [f"wf-owner-holder:bench-{i:06d}" for i in range(count)]
        self.generation = 0

    def value(self, generation: int) -> bytes:
        return f"holder engine-1 expires-at {generation:012d}".encode().ljust(64, b".")

    def next_batches(self) -> Batches:
        old, new = self.value(self.generation), self.value(self.generation + 1)
        self.generation += 1
        return [([Condition(k, old)], [Put(k, new)]) for k in self.keys]


def _time(fn: Callable[[], int], expected: int) -> float:
    started = time.perf_counter()
    renewed = fn()
    elapsed = time.perf_counter() - started
    if renewed != expected:
        raise SystemExit(f"renewed {renewed} of {expected} keys: the benchmark state is broken")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    table = "bench_" + uuid.uuid4().hex[:12]
    with _server_url() as url:
        store = PostgresStorage(url, table=table)
        raw = psycopg.connect(url, autocommit=True)
        try:
            keys = _Keys(args.keys)
            store.batch([Put(k, keys.value(0)) for k in keys.keys])
            raw_update = (
                f'UPDATE "{table}" AS t SET value = u.v '
                "FROM unnest(%b::text[], %b::bytea[], %b::bytea[]) AS u(k, e, v) "
                "WHERE t.key = u.k AND t.value = u.e RETURNING t.key"
            )

            def fast() -> int:
                return sum(store.conditional_batches(keys.next_batches()))

            def general() -> int:
                return sum(store.conditional_batches([*keys.next_batches(), ([], [])])) - 1

            def floor() -> int:
                batches = keys.next_batches()
                cols = (
                    [b[0][0].key for b in batches],
                    [b[0][0].expected for b in batches],
                    [op.value for b in batches for op in b[1] if isinstance(op, Put)],
                )
                return len(raw.execute(raw_update, cols).fetchall())

            timings: dict[str, list[float]] = {"fast": [], "general": [], "raw": []}
            fast()  # warm up connections and plans once
            floor()
            for _ in range(args.runs):
                timings["raw"].append(_time(floor, args.keys))
                timings["fast"].append(_time(fast, args.keys))
                timings["general"].append(_time(general, args.keys))
        finally:
            raw.execute(f'DROP TABLE IF EXISTS "{table}"')
            raw.close()
            store.close()
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"renewing {args.keys} keys, median of {args.runs} runs:")
    for name in ("raw", "fast", "general"):
        print(f"  {name:8s} {medians[name] * 1000:9.1f} ms")
    print(f"  fast / raw     = {medians['fast'] / medians['raw']:.2f}x")
    print(f"  general / fast = {medians['general'] / medians['fast']:.1f}x")


if __name__ == "__main__":
    main()
