"""What the by-engine index costs: acquire + release with and without the entry, and the backfill.

- ``cycles``: one cycle is ``registry.acquire(id)`` then ``registry.release(id)`` on fresh ids,
  one thread. ``with entry`` is the library as it is; ``without entry`` is the same registry on
  a store wrapper that drops the by-engine operations from every batch (what a version without
  the index writes). Both run in the same process, interleaved; the ratio is the entry's cost.
  Renewal never touches the entry, so its cost is unchanged (``bench/renewal_pass.py``).
- ``backfill``: a store seeded with N holders and no entries (as written before the index) is
  indexed with ``backfill_step`` (budget 1,000 keys a step) until the marker is written: total
  time, steps, and holders indexed per second.
- ``migration``: the same store without its marker (an upgraded store) under the reclaim
  discovery of a running engine (``EngineIndexDiscovery.discover``, what each maintenance pass
  runs): how many passes until the marker is written, how long each of them took, against a
  pass of the full scans alone (what a migrating pass cost before it ran a whole sweep) and a
  pass once the store is indexed.

    python bench/engine_index.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ENGINE_ID,
    Site,
    bench_site,
    interleave,
    machine_note,
    ms,
    new_registry,
    parse_args,
    print_table,
    ratio,
    selected_backends,
    workflow_ids,
    write_in_chunks,
)
from weft_sync import keys
from weft_sync.claims.engine_index import backfill_step, index_marker_present
from weft_sync.claims.transitions import build_acquire_transition
from weft_sync.clock import system_clock
from weft_sync.reclaim.discoveries import expiry_judge
from weft_sync.reclaim.engine_discovery import EngineIndexDiscovery
from weft_sync.reclaim.scan import discover_reclaim_candidates
from weft_sync.storage import Condition, Operation, Storage
from weft_sync.storage.base import Batch

_ENTRY_PREFIX = keys.workflow_owner_by_engine_prefix("")
BACKFILL_BUDGET = 1_000


class WithoutEntries:
    """A real store whose batches lose their by-engine operations (a version without the index)."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        return self._inner.conditional_batch(conditions, _strip(operations))

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        return self._inner.conditional_batches([(c, _strip(o)) for c, o in batches])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _strip(operations: Sequence[Operation]) -> list[Operation]:
    return [op for op in operations if not op.key.startswith(_ENTRY_PREFIX)]


def bench_cycles(site: Site, backend: str, cycles: int, repeats: int) -> list[list[object]]:
    spec = site.new_store(backend, "cycles")
    counter = itertools.count()
    with contextlib.closing(spec.open()) as storage:
        registries = {
            "with entry": new_registry(storage),
            "without entry": new_registry(WithoutEntries(storage)),
        }

        def run(name: str) -> None:
            registry = registries[name]
            for wid in workflow_ids(cycles, f"{name[:4]}-{next(counter)}"):
                registry.acquire(wid)
                registry.release(wid)

        samples = interleave({name: functools.partial(run, name) for name in registries}, repeats)
    with_entry, without = samples["with entry"], samples["without entry"]
    return [
        [
            backend,
            cycles,
            f"{cycles / with_entry.median_wall:,.0f}/s",
            f"{cycles / without.median_wall:,.0f}/s",
            ratio(with_entry.median_wall, without.median_wall),
            ratio(with_entry.median_cpu, without.median_cpu),
        ]
    ]


def seed_old_holders(storage: Storage, count: int) -> None:
    now = system_clock()
    operations: list[Operation] = []
    for wid in workflow_ids(count, "old"):
        fragment = build_acquire_transition(
            workflow_id=wid,
            engine_id=ENGINE_ID,
            now=now,
            claim_ttl_ms=30_000,
            observed_epoch_bytes=None,
        )
        operations += fragment.operations
    write_in_chunks(storage, operations)


def bench_backfill(site: Site, backend: str, count: int) -> list[list[object]]:
    spec = site.new_store(backend, "backfill")
    with contextlib.closing(spec.open()) as storage:
        started = time.perf_counter()
        seed_old_holders(storage, count)
        seeding = time.perf_counter() - started
        cursor: str | None = None
        steps = written = 0
        started = time.perf_counter()
        while True:
            step = backfill_step(storage, cursor=cursor, budget=BACKFILL_BUDGET)
            steps += 1
            written += step.written
            if step.done:
                break
            cursor = step.cursor
        elapsed = time.perf_counter() - started
    assert written == count, f"indexed {written} of {count} holders"
    return [[backend, f"{count:,}", ms(seeding), ms(elapsed), steps, f"{count / elapsed:,.0f}/s"]]


def bench_migration(site: Site, backend: str, count: int) -> list[list[object]]:
    spec = site.new_store(backend, "migration")
    with contextlib.closing(spec.open()) as storage:
        seed_old_holders(storage, count)
        storage.delete(keys.OWNER_INDEX_MARKER)
        judge = expiry_judge(system_clock, 5_000)
        started = time.perf_counter()
        discover_reclaim_candidates(storage, (), judge=judge, skip_live=True)
        scans_only = time.perf_counter() - started
        discovery = EngineIndexDiscovery(
            storage, engine_id="bench-judge", clock=system_clock, judge=judge
        )
        passes: list[float] = []
        while not index_marker_present(storage):
            if len(passes) == 10:
                raise SystemExit(f"{backend}: no marker after {len(passes)} migrating passes")
            started = time.perf_counter()
            discovery.discover(())
            passes.append(time.perf_counter() - started)
        started = time.perf_counter()
        discovery.discover(())
        indexed = time.perf_counter() - started
    return [
        [
            backend,
            f"{count:,}",
            len(passes),
            " + ".join(ms(p) for p in passes),
            ms(scans_only),
            f"{max(passes) / scans_only:.1f}x",
            ms(indexed),
        ]
    ]


def main() -> None:
    args = parse_args(__doc__)
    backends = selected_backends(args)
    repeats = args.repeats or (3 if args.quick else 7)
    cycles = 200 if args.quick else 1_000
    sizes = (2_000,) if args.quick else (10_000, 100_000)
    print(f"by-engine index benchmark; {machine_note()}")
    cycle_rows: list[list[object]] = []
    backfill_rows: list[list[object]] = []
    migration_rows: list[list[object]] = []
    migration_sizes = (2_000,) if args.quick else (20_000, 200_000)
    with bench_site(backends) as site:
        for backend in backends:
            cycle_rows += bench_cycles(site, backend, cycles, repeats)
            for size in sizes:
                backfill_rows += bench_backfill(site, backend, size)
            for size in migration_sizes:
                migration_rows += bench_migration(site, backend, size)
    print_table(
        f"acquire + release, one thread, median of {repeats} (ratio: with / without entry)",
        ["backend", "cycles", "with entry", "without entry", "wall ratio", "cpu ratio"],
        cycle_rows,
    )
    print_table(
        f"backfill of a store without entries (budget {BACKFILL_BUDGET:,} keys a step)",
        ["backend", "holders", "seeding", "backfill", "steps", "indexed"],
        backfill_rows,
    )
    print_table(
        "an upgraded store under a running engine's discovery: passes until the marker",
        ["backend", "holders", "passes", "each pass", "scans only", "longest / scans", "indexed"],
        migration_rows,
    )


if __name__ == "__main__":
    main()
