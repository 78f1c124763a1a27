"""Maintenance cost against store size: one engine's pass when N live claims belong to others.

The store holds N live claims of K = 8 other engines (real ``Ownership`` engines opened on it,
``background="manual"``, whose ids the seeded holders name) and nothing is stranded, so the
right amount of work is about zero. Measured for each N (10k / 100k / 1M; ``--quick``: 10k /
100k), passes interleaved in the same run:

- ``old``: an engine with ``OwnershipOptions(reclaim_discovery="scan")``, the full scan of every
  holder, running-index entry and a window of workflow records;
- ``new``: an engine with the default discovery (``"auto"``: engine records, session locks and
  the by-engine index).

Each figure is the median and the max of the passes (``--repeats`` rounds, 5; each round runs
one pass of the old engine, none after the third round at 1M and above, and three of the new
one, whose passes are cheap and noisier): the wall time of ``Ownership.run_maintenance()`` and
of its reclaim sub-pass (the ``weft_workflow_claim_pass_seconds{subpass="reclaim"}``
histogram). Untimed warm-up passes come first (1 old, 10 new: the first few are slower while
psycopg prepares statements), then as many new passes as move its rotating windows half way
through the store (N / 512: a window is measured where it usually is, not at the start of its
range), and a garbage collection before each pass. Before each pass the
other engines run one maintenance pass of their own (not timed), so their heartbeats stay fresh
however long the old discovery's passes take.

Seeding writes raw rows (``bench/scale_seed.py``): per claim the epoch, the holder (expiring in
2096), the running workflow record, its status-index entry and the by-engine index entry. N grows
in place (10k, then up to 100k, then up to 1M), and the time each step took is printed.

``--dead`` adds, at the largest N, 10,000 claims of one more engine that dies, driven by three
survivor processes (this script in worker mode, default TTL 30 s, renew 5 s, ``max_claims``
unset, each recording every drive of its handler with a timestamp):

- ``crash``: the dead engine is a real process (``Ownership`` with interval maintenance) that
  holds its session lock; its claims are seeded as live (expiring a TTL later); it is SIGKILLed.
  Measured from the kill;
- ``stale``: an engine record without a lock whose heartbeat, like every holder it names, expired
  long ago. Measured from the commit that seeded it.

Each row gives the time until the first and until all 10,000 were held by survivors and driven
(the holders are read back from the store at the end), each survivor's share, the workflows
driven twice, how often a survivor's reclaim sub-pass was still running when its next tick came
(``overruns``, from the warnings the survivors log), and whether the last drive came within the
takeover bound TTL + 2 x renew + one interval (+3 s allowed).

``--keep DIR`` keeps the seeded SQLite file and PostgreSQL table (with a manifest of the table
name and claim count) in DIR, so a later run reuses them and seeds only what is missing (a size
below what the kept store holds is skipped); ``--keep DIR --drop`` removes them. Without
``--keep`` the PostgreSQL table is dropped at the end of the run.

    python bench/scale.py [--quick] [--sizes 10k,100k,1M] [--repeats N] [--old-up-to N]
        [--backend sqlite|postgres|both] [--keep DIR [--drop]] [--dead | --dead-only]
        [--scenarios crash,stale] [--dead-old]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    StoreSpec,
    bench_site,
    machine_note,
    parse_args,
    print_table,
    selected_backends,
)
from bench.scale_dead import bench_dead, worker_main
from bench.scale_fleet import OTHERS, Fleet, claim_id, other_ids
from bench.scale_seed import (
    Seeder,
    check_seed_format,
    drop_kept,
    kept_store,
    save_manifest,
)
from weft_sync import Ownership, keys
from weft_sync.reclaim.engine_discovery import DISCOVERY_WINDOW

WARM_PASSES = 10
NEW_PER_ROUND = 3
FULL_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
TARGET_MS = 10.0
FLAT_TARGET = 2.0


def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 10k, 100000 or 1M")
    return int(digits) * scale


def sizes_arg(text: str) -> tuple[int, ...]:
    return tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))


# -- the steady state -----------------------------------------------------------------------


@dataclass
class PassSamples:
    wall: list[float] = field(default_factory=list)
    reclaim: list[float] = field(default_factory=list)

    def cell(self) -> str:
        if not self.wall:
            return "not run"
        return f"{_ms(statistics.median(self.wall))} (max {_ms(max(self.wall))})"

    def reclaim_cell(self) -> str:
        if not self.reclaim:
            return "not run"
        return f"{_ms(statistics.median(self.reclaim))} (max {_ms(max(self.reclaim))})"


def _ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _reclaim_total(ownership: Ownership) -> float:
    return ownership.metrics.snapshot().pass_seconds["reclaim"].total


def measure_size(
    fleet: Fleet, repeats: int, size: int, old_up_to: int | None = None
) -> dict[str, PassSamples]:
    """Interleaved passes of every measured engine; each checked to have reclaimed nothing.

    :param old_up_to: above this size the old discovery is not run (its passes take a minute)
        and its engine is closed.
    """
    if old_up_to is not None and size > old_up_to:
        fleet.retire("old")
    samples = {column: PassSamples() for column in fleet.columns}
    engines = dict(fleet.measured)
    for column, ownership in engines.items():
        # Warm caches, connections and (psycopg prepares a statement on its 5th run) plans.
        for _ in range(1 if column == "old" else WARM_PASSES):
            fleet.heartbeat()
            _one_pass(ownership, column, size)
    if "new" in engines:
        # Measured where a window usually is, half way through the store, not at its start.
        for _ in range(size // (2 * DISCOVERY_WINDOW)):
            _one_pass(engines["new"], "new", size)
    for round_ in range(repeats):
        for column, ownership in engines.items():
            if column == "old" and size >= 1_000_000 and round_ >= 3:
                continue
            for _ in range(1 if column == "old" else NEW_PER_ROUND):
                fleet.heartbeat()
                gc.collect()
                wall, reclaim = _one_pass(ownership, column, size)
                samples[column].wall.append(wall)
                samples[column].reclaim.append(reclaim)
    return samples


def _one_pass(ownership: Ownership, column: str, size: int) -> tuple[float, float]:
    before = _reclaim_total(ownership)
    started = time.perf_counter()
    result = ownership.run_maintenance()
    wall = time.perf_counter() - started
    reclaim = result.reclaim
    if reclaim is None or reclaim.status != "completed" or reclaim.reclaimed_count:
        raise SystemExit(f"{column} discovery at {size:,}: unexpected reclaim result {reclaim!r}")
    return wall, _reclaim_total(ownership) - before


def grow(seeder: Seeder, have: int, size: int) -> float:
    """Seed claims ``have`` .. ``size - 1``; return the seconds it took (with ANALYZE)."""
    started = time.perf_counter()
    seeder.seed_claims([claim_id(n) for n in range(have, size)], other_ids())
    seeder.vacuum_analyze()
    return time.perf_counter() - started


def seeded_count(seeder: Seeder) -> int:
    holders = seeder.count_prefix(keys.workflow_owner_holder("wf-"))
    indexed = sum(seeder.count_prefix(keys.workflow_owner_by_engine(e, "wf-")) for e in other_ids())
    if indexed != holders:
        raise SystemExit(f"the kept store has {holders} holders but {indexed} by-engine entries")
    return holders


@dataclass
class SizeRow:
    size: int
    seeding: str
    samples: dict[str, PassSamples]


def bench_backend(
    fleet: Fleet,
    sizes: Sequence[int],
    repeats: int,
    *,
    measure: bool = True,
    old_up_to: int | None = None,
) -> list[SizeRow]:
    """Grow the store through ``sizes``, measuring passes at each (only seeding without
    ``measure``)."""
    spec = fleet.spec
    seeder = Seeder(spec)
    fleet.wait_for_index_marker(seeder)
    check_seed_format(seeder, next(iter(fleet.measured.values())))
    have = seeded_count(seeder)
    rows: list[SizeRow] = []
    for size in sizes:
        if have > size:
            print(f"{spec.backend}: the store holds {have:,} claims, more than {size:,}: skipped")
            continue
        seconds = grow(seeder, have, size) if size > have else 0.0
        note = f"{seconds:.1f} s (+{size - have:,})" if size > have else "kept"
        print(f"{spec.backend}: {size:,} claims seeded, {note}", flush=True)
        have = size
        if measure:
            rows.append(SizeRow(size, note, measure_size(fleet, repeats, size, old_up_to)))
            report_size(spec.backend, rows[-1])
    return rows


def report_size(backend: str, row: SizeRow) -> None:
    print_table(
        f"{backend}, {row.size:,} live claims of {OTHERS} other engines, nothing stranded "
        f"(median and max of {', '.join(f'{len(s.wall)}' for s in row.samples.values())} passes)",
        ["discovery", "run_maintenance", "reclaim sub-pass"],
        [[name, s.cell(), s.reclaim_cell()] for name, s in row.samples.items()],
    )
    for name, samples in row.samples.items():
        if not samples.wall:
            continue
        passes = ", ".join(f"{w * 1000:,.1f}" for w in samples.wall)
        print(f"  {name}, every pass (ms): {passes}")


def summarize(backend: str, rows: list[SizeRow]) -> list[str]:
    """Ratios largest / smallest N and the new discovery against its target."""
    lines: list[str] = []
    if len(rows) < 2:
        return lines
    small, large = rows[0], rows[-1]
    for column in small.samples:
        a, b = small.samples[column].wall, large.samples[column].wall
        if a and b:
            flat = statistics.median(b) / statistics.median(a)
            verdict = "" if column == "old" else (" MET" if flat <= FLAT_TARGET else " MISSED")
            lines.append(
                f"{backend} {column}: {large.size:,} / {small.size:,} = {flat:.2f}x"
                + (f" (target <= {FLAT_TARGET}x:{verdict})" if column != "old" else "")
            )
    new = large.samples.get("new")
    if new is not None and new.wall:
        at = statistics.median(new.wall) * 1000
        met = "MET" if at <= TARGET_MS else "MISSED"
        lines.append(
            f"{backend} new at {large.size:,}: {at:.1f} ms (target <= {TARGET_MS} ms: {met})"
        )
    old = large.samples.get("old")
    if new is not None and old is not None and new.wall and old.wall:
        lines.append(
            f"{backend} old / new at {large.size:,}: "
            f"{statistics.median(old.wall) / statistics.median(new.wall):,.0f}x"
        )
    return lines


# -- main -----------------------------------------------------------------------------------


def scenarios_arg(text: str) -> tuple[str, ...]:
    found = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [part for part in found if part not in ("crash", "stale")]
    if bad or not found:
        raise argparse.ArgumentTypeError(f"invalid scenarios {text!r}: use crash, stale or both")
    return found


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=sizes_arg, default=None, help="e.g. 10k,100k,1M")
    parser.add_argument(
        "--old-up-to", type=parse_size, default=None, help="run the old discovery up to this N"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep (and reuse) stores in DIR")
    parser.add_argument("--drop", action="store_true", help="remove the stores kept in --keep")
    parser.add_argument("--dead", action="store_true", help="add the dead-engine case")
    parser.add_argument("--dead-only", action="store_true", help="only the dead-engine case")
    parser.add_argument(
        "--scenarios",
        type=scenarios_arg,
        default=("crash", "stale"),
        help="dead-engine scenarios, of crash,stale",
    )
    parser.add_argument(
        "--dead-old", action="store_true", help="the dead-engine case with the old discovery too"
    )
    parser.add_argument("--worker", choices=("survivor", "dead"), help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--discovery", choices=("auto", "scan"), help=argparse.SUPPRESS)


def run_backend(
    backend: str, spec: StoreSpec, args: argparse.Namespace, manifest: dict[str, Any] | None
) -> list[str]:
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or 5
    lines: list[str] = []
    fleet = Fleet(spec)
    try:
        if args.dead_only:
            bench_backend(fleet, (max(sizes),), repeats, measure=False)
        else:
            rows = bench_backend(fleet, sizes, repeats, old_up_to=args.old_up_to)
            lines += summarize(backend, rows)
        if manifest is not None:
            manifest["claims"] = seeded_count(Seeder(spec))
            save_manifest(args.keep, backend, manifest)
        if args.dead or args.dead_only:
            bench_dead(fleet, max(sizes), args.scenarios, args.dead_old)
    finally:
        fleet.close()
    return lines


def main() -> None:
    args = parse_args(__doc__, configure)
    if args.worker:
        worker_main(args)
        return
    if args.drop:
        if args.keep is None:
            raise SystemExit("--drop removes the stores of --keep DIR: give --keep")
        drop_kept(args.keep, os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN"))
        return
    print(f"scale benchmark; {machine_note()}", flush=True)
    backends = selected_backends(args)
    lines: list[str] = []
    with bench_site(backends) as site:
        for backend in backends:
            if args.keep is not None:
                spec, manifest = kept_store(args.keep, backend, site.pg_url)
                lines += run_backend(backend, spec, args, manifest)
            else:
                spec = site.new_store(backend, "scale")
                try:
                    lines += run_backend(backend, spec, args, None)
                finally:
                    Seeder(spec).drop()
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
