"""Memory per held claim: the registry's state at 100,000 claims (tracemalloc and RSS delta).

Each measurement runs in a fresh spawned interpreter. The claims' durable bytes are written to a
SQLite store first (not counted); the id strings are created before measuring and stay alive in
the caller, so they are not counted either. Then the registry tracks every claim
(``record_folded_acquire`` of the exact bytes an acquire writes), the temporary fragments are
dropped, and the growth is read:

- ``tracemalloc``: Python allocations still live (entries, the claims map, epoch and holder
  bytes), with the tracer running only around the measured step;
- ``RSS delta``: the process's resident set growth for the same step, without the tracer
  (includes allocator slack; an upper bound).

Both are read again after one ``renew_many`` over every claim (new holder bytes replace the old
ones; the RSS figure then also holds SQLite's page cache, a C allocation tracemalloc never sees).

    python bench/memory.py [--quick] [--claims N]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    TTL_MS,
    machine_note,
    new_registry,
    parse_args,
    print_table,
    rss_bytes,
    workflow_ids,
    write_in_chunks,
)
from weft_sync.claims.results import AcquirePreparation
from weft_sync.claims.transitions import build_acquire_transition
from weft_sync.clock import system_clock
from weft_sync.storage import SqliteStorage


def _preparations(engine_id: str, ids: list[str], now: int) -> list[AcquirePreparation]:
    return [
        AcquirePreparation(
            build_acquire_transition(
                workflow_id=wid,
                engine_id=engine_id,
                now=now,
                claim_ttl_ms=TTL_MS,
                observed_epoch_bytes=None,
            ),
            1,
            now,
        )
        for wid in ids
    ]


def _measure(use_tracemalloc: bool, claims: int, results: Any) -> None:
    """Child process: track ``claims`` claims, put (held, after renew_many) growth in bytes."""
    ids = workflow_ids(claims)
    now = system_clock()
    with tempfile.TemporaryDirectory() as tmp, SqliteStorage(Path(tmp) / "mem.db") as storage:
        registry = new_registry(storage)
        durable = _preparations(registry.engine_id, ids, now)
        write_in_chunks(storage, [op for p in durable for op in p.fragment.operations])
        del durable

        def reading() -> int:
            gc.collect()
            return tracemalloc.get_traced_memory()[0] if use_tracemalloc else rss_bytes()

        if use_tracemalloc:
            tracemalloc.start()
        base = reading()
        preparations = _preparations(registry.engine_id, ids, now)
        for wid, preparation in zip(ids, preparations, strict=True):
            registry.record_folded_acquire(wid, preparation)
        del preparations
        held = reading() - base
        renewed = registry.renew_many(ids)
        if sum(1 for r in renewed if r.status == "renewed") != claims:
            raise SystemExit("renew_many did not renew every claim")
        del renewed
        after_renew = reading() - base
        if use_tracemalloc:
            tracemalloc.stop()
    results.put((held, after_renew))


def measure(use_tracemalloc: bool, claims: int) -> tuple[int, int]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(use_tracemalloc, claims, results))
    proc.start()
    try:
        held, after = results.get(timeout=600)
    finally:
        proc.join(timeout=60)
    return int(held), int(after)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=None, help="claims to hold")


def main() -> None:
    args = parse_args(__doc__, configure)
    claims = args.claims or (20_000 if args.quick else 100_000)
    print(f"memory benchmark; {machine_note()}")
    rows = []
    for name, traced in (("tracemalloc", True), ("RSS delta", False)):
        held, after = measure(traced, claims)
        rows.append(
            [
                name,
                f"{held / 2**20:,.1f} MiB",
                f"{held / claims:,.0f} B",
                f"{after / 2**20:,.1f} MiB",
                f"{after / claims:,.0f} B",
            ]
        )
    print_table(
        f"registry state for {claims:,} held claims",
        ["measure", "held", "per claim", "after renew_many", "per claim"],
        rows,
    )


if __name__ == "__main__":
    main()
