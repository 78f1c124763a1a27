"""Maintenance cost against store size: one engine's pass when N live claims belong to others.

The store holds N live claims of K = 8 other engines (real ``Ownership`` engines opened on it,
``background="manual"``, whose ids the seeded holders name) and nothing is stranded, so the
right amount of work is about zero. Measured for each N (10k / 100k / 1M; ``--quick``: 10k /
100k), passes interleaved in the same run:

- ``old``: an engine with ``OwnershipOptions(reclaim_discovery="scan")``, the full scan of every
  holder, running-index entry and a window of workflow records;
- ``new``: an engine with the default discovery (``"auto"``: engine records, session locks and
  the by-engine index). Shown as ``n/a`` when the library has no ``reclaim_discovery`` option.

Each figure is the median and the max of the passes (``--repeats`` rounds, 5; each round runs
one pass of the old engine, none after the third round at 1M and above, and three of the new
one, whose passes are cheap and noisier): the wall time of ``Ownership.run_maintenance()`` and
of its reclaim sub-pass (the ``weft_workflow_claim_pass_seconds{subpass="reclaim"}``
histogram). Untimed warm-up passes come first (1 old, 10 new: the first few are slower while
psycopg prepares statements), and a garbage collection before each pass. Before each pass the
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
below what the kept store holds is skipped); ``--keep DIR --drop`` removes them.

    python bench/scale.py [--quick] [--sizes 10k,100k,1M] [--repeats N]
        [--backend sqlite|postgres|both] [--keep DIR] [--dead] [--dead-only]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
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
from bench.scale_seed import (
    HAS_OWNER_INDEX,
    SEED_TYPE,
    Seeder,
    by_engine_key,
    check_seed_format,
    drop_kept,
    kept_store,
    owner_index_marker,
    save_manifest,
)
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow, keys
from weft_sync.codec import decode_holder

OTHERS = 8
WARM_PASSES = 10
NEW_PER_ROUND = 3
FULL_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
TARGET_MS = 10.0
FLAT_TARGET = 2.0
DEAD_CLAIMS = 10_000
SURVIVORS = ("scale-survivor-1", "scale-survivor-2", "scale-survivor-3")
ALLOWED_S = 3.0
URL_ENV = "WEFT_SCALE_URL"
HAS_DISCOVERY_OPTION = "reclaim_discovery" in getattr(OwnershipOptions, "__dataclass_fields__", {})
"""Whether the library can choose between the old full scan and the new discovery."""


def options_for(mode: str | None) -> OwnershipOptions:
    """Default claim timing; ``mode`` picks the discovery (``None``: the library's only one)."""
    if mode is None:
        return OwnershipOptions()
    # Through a mapping, so this file also runs on a library without the option (then unused).
    chosen: dict[str, Any] = {"reclaim_discovery": mode}
    return OwnershipOptions(**chosen)


def modes() -> dict[str, str | None]:
    """Column name -> discovery option of every discovery this library has."""
    if HAS_DISCOVERY_OPTION:
        return {"old": "scan", "new": "auto"}
    return {"old": None}


def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 10k, 100000 or 1M")
    return int(digits) * scale


def sizes_arg(text: str) -> tuple[int, ...]:
    return tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))


def claim_id(n: int) -> str:
    return f"wf-{n:07d}"


def other_ids() -> list[str]:
    return [f"scale-other-{n}" for n in range(OTHERS)]


# -- the steady state -----------------------------------------------------------------------


@dataclass
class PassSamples:
    wall: list[float] = field(default_factory=list)
    reclaim: list[float] = field(default_factory=list)

    def cell(self) -> str:
        if not self.wall:
            return "n/a"
        return f"{_ms(statistics.median(self.wall))} (max {_ms(max(self.wall))})"

    def reclaim_cell(self) -> str:
        if not self.reclaim:
            return "n/a"
        return f"{_ms(statistics.median(self.reclaim))} (max {_ms(max(self.reclaim))})"


def _ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _reclaim_total(ownership: Ownership) -> float:
    return ownership.metrics.snapshot().pass_seconds["reclaim"].total


def _refuse_drive(ctx: ReclaimedWorkflow) -> None:
    raise SystemExit(f"a measured engine drove {ctx.workflow_id!r}, a live claim of another engine")


class Fleet:
    """The other engines and one measured engine per discovery, all open on one store."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self._stack = contextlib.ExitStack()
        self.others = [self._open(engine, options_for(None)) for engine in other_ids()]
        self.measured = {
            column: self._open(
                f"scale-measured-{column}", options_for(mode), handlers={SEED_TYPE: _refuse_drive}
            )
            for column, mode in modes().items()
        }

    def _open(
        self, engine: str, options: OwnershipOptions, handlers: dict[str, Any] | None = None
    ) -> Ownership:
        ownership = Ownership.open(
            self.spec.url,
            options=options,
            background="manual",
            engine_id=engine,
            handlers=handlers,
        )
        self._stack.callback(ownership.close)
        return ownership

    def heartbeat(self) -> None:
        """One maintenance pass of every other engine (its heartbeat, with the new discovery)."""
        if HAS_DISCOVERY_OPTION:
            for ownership in self.others:
                ownership.run_maintenance()

    def wait_for_index_marker(self, seeder: Seeder) -> None:
        """Let the new engine's backfill mark the (still empty) store as fully indexed."""
        if not HAS_DISCOVERY_OPTION:
            return
        marker = [owner_index_marker()]
        for _ in range(20):
            if seeder.read_prefix(marker[0]):
                return
            self.measured["new"].run_maintenance()
        raise SystemExit("the owner index backfill never set its marker on an empty store")

    def close(self) -> None:
        self._stack.close()


def measure_size(fleet: Fleet, repeats: int, size: int) -> dict[str, PassSamples]:
    """Interleaved passes of every measured engine; each checked to have reclaimed nothing."""
    samples = {column: PassSamples() for column in fleet.measured}
    for column, ownership in fleet.measured.items():
        # Warm caches, connections and (psycopg prepares a statement on its 5th run) plans.
        for _ in range(1 if column == "old" else WARM_PASSES):
            fleet.heartbeat()
            _one_pass(ownership, column, size)
    for round_ in range(repeats):
        for column, ownership in fleet.measured.items():
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
    indexed = sum(seeder.count_prefix(by_engine_key(e, "wf-")) for e in other_ids())
    if HAS_OWNER_INDEX and indexed != holders:
        raise SystemExit(f"the kept store has {holders} holders but {indexed} by-engine entries")
    return holders


@dataclass
class SizeRow:
    size: int
    seeding: str
    samples: dict[str, PassSamples]


def bench_backend(
    fleet: Fleet, sizes: Sequence[int], repeats: int, *, measure: bool = True
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
            rows.append(SizeRow(size, note, measure_size(fleet, repeats, size)))
            report_size(spec.backend, rows[-1])
    return rows


def report_size(backend: str, row: SizeRow) -> None:
    print_table(
        f"{backend}, {row.size:,} live claims of {OTHERS} other engines, nothing stranded "
        f"(median and max of {', '.join(f'{len(s.wall)}' for s in row.samples.values())} passes)",
        ["discovery", "run_maintenance", "reclaim sub-pass"],
        [[name, s.cell(), s.reclaim_cell()] for name, s in row.samples.items()]
        + (
            [["new", "n/a (no reclaim_discovery option)", "n/a"]]
            if not HAS_DISCOVERY_OPTION
            else []
        ),
    )


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
    if not HAS_DISCOVERY_OPTION:
        lines.append(f"{backend} new: n/a (this library has no reclaim_discovery option)")
    return lines


# -- the dead engine ------------------------------------------------------------------------


@dataclass
class DeadRun:
    scenario: str
    column: str
    elapsed_s: float | None
    first_s: float | None
    shares: dict[str, int]
    driven: int
    twice: int
    held_by_survivors: int
    overruns: int


def spawn_worker(
    role: str, name: str, workdir: Path, spec: StoreSpec, mode: str | None
) -> subprocess.Popen[bytes]:
    """Run this script as a ``role`` worker; the store URL goes by environment, never argv."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, URL_ENV: spec.url, "PYTHONPATH": str(root)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--name", name]
    command += ["--workdir", str(workdir), *(["--discovery", mode] if mode else [])]
    with (workdir / f"{name}.err").open("wb") as err:
        return subprocess.Popen(command, env=env, stderr=err)


def worker_errors(workdir: Path) -> tuple[int, list[str]]:
    """How many overrun warnings the workers logged, and every other line they wrote."""
    overruns, other = 0, []
    for path in sorted(workdir.glob("*.err")):
        for line in path.read_text(errors="replace").splitlines():
            if "still running after one interval" in line:
                overruns += 1
            elif line.strip():
                other.append(f"{path.stem}: {line}")
    return overruns, other


class Survivors:
    """Three survivor processes, each recording its drives to its own file."""

    def __init__(self, spec: StoreSpec, workdir: Path, mode: str | None) -> None:
        self.workdir = workdir
        self.stop_file = workdir / "stop"
        self.procs = [spawn_worker("survivor", name, workdir, spec, mode) for name in SURVIVORS]
        _wait_for_files([workdir / f"{name}.ready" for name in SURVIVORS], self.procs)

    def drives(self) -> list[tuple[str, float, str]]:
        """Every drive so far: (survivor, monotonic time, workflow id)."""
        found: list[tuple[str, float, str]] = []
        for name in SURVIVORS:
            path = self.workdir / f"{name}.drives"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                at, _, wid = line.partition(" ")
                if wid:
                    found.append((name, float(at), wid))
        return found

    def close(self) -> None:
        self.stop_file.touch()
        for proc in self.procs:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _wait_for_files(paths: Sequence[Path], procs: Sequence[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 180
    while not all(p.exists() for p in paths):
        if any(proc.poll() is not None for proc in procs):
            raise SystemExit("a worker process exited before it was ready")
        if time.monotonic() > deadline:
            raise SystemExit("a worker process did not get ready within 180 s")
        time.sleep(0.05)


@contextlib.contextmanager
def heartbeating(fleet: Fleet) -> Iterator[None]:
    """Keep the other engines' heartbeats fresh (one pass each per renew interval) meanwhile."""
    stop = threading.Event()
    renew_s = options_for(None).claim_renew_interval_ms / 1000

    def loop() -> None:
        while not stop.wait(renew_s):
            fleet.heartbeat()

    thread = threading.Thread(target=loop, name="scale-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(120)


def dead_run(
    spec: StoreSpec, fleet: Fleet, scenario: str, column: str, mode: str | None, tag: str
) -> DeadRun:
    seeder = Seeder(spec)
    ids = [f"dead-{tag}-{n:05d}" for n in range(DEAD_CLAIMS)]
    dead_engine = f"scale-dead-{tag}"
    options = options_for(mode)
    with tempfile.TemporaryDirectory(prefix="weft-scale-") as tmp:
        workdir = Path(tmp)
        survivors = Survivors(spec, workdir, mode)
        try:
            with heartbeating(fleet):
                if scenario == "crash":
                    t0 = _crash(spec, seeder, workdir, dead_engine, ids, mode, survivors)
                else:
                    t0 = _stale(seeder, dead_engine, ids, options)
                elapsed = _wait_driven(survivors, ids, t0, options)
                time.sleep(options.claim_renew_interval_ms / 1000)  # a second drive would show
                events = survivors.drives()
                holders = seeder.read_prefix(keys.workflow_owner_holder(f"dead-{tag}-"))
        finally:
            survivors.close()
            _clean_dead(seeder, tag, dead_engine)
        overruns, errors = worker_errors(workdir)
    for line in errors[-20:]:
        print(f"  {line}")
    counts: dict[str, int] = {}
    shares = dict.fromkeys(SURVIVORS, 0)
    for name, _, wid in events:
        counts[wid] = counts.get(wid, 0) + 1
        shares[name] += 1
    held = sum(
        1 for _, value in holders if (h := decode_holder(value)) and h.engine_id in SURVIVORS
    )
    first = min((at for _, at, _ in events), default=None)
    return DeadRun(
        scenario=scenario,
        column=column,
        elapsed_s=elapsed,
        first_s=None if first is None else first - t0,
        shares=shares,
        driven=len(counts),
        twice=sum(1 for n in counts.values() if n > 1),
        held_by_survivors=held,
        overruns=overruns,
    )


def _crash(
    spec: StoreSpec,
    seeder: Seeder,
    workdir: Path,
    dead_engine: str,
    ids: list[str],
    mode: str | None,
    survivors: Survivors,
) -> float:
    options = options_for(mode)
    proc = spawn_worker("dead", dead_engine, workdir, spec, mode)
    try:
        _wait_for_files([workdir / f"{dead_engine}.ready"], [proc])
        now = int(time.time() * 1000)
        seeder.seed_claims(
            ids, [dead_engine], expires_at=now + options.claim_ttl_ms, claimed_at=now
        )
        # Every survivor runs a pass while the engine lives, so it knows the engine and its lock.
        time.sleep(options.claim_renew_interval_ms / 1000 + 1.0)
        if survivors.drives():
            raise SystemExit("a survivor drove a live engine's claim before the kill")
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        return t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _stale(seeder: Seeder, dead_engine: str, ids: list[str], options: OwnershipOptions) -> float:
    record = stale_engine_record(dead_engine, options)
    if record is None:
        raise SystemExit("no engine liveness records in this library: the stale case is n/a")
    long_ago = int(time.time() * 1000) - 10 * options.claim_ttl_ms
    seeder.seed_claims(
        ids, [dead_engine], expires_at=long_ago + options.claim_ttl_ms, claimed_at=long_ago
    )
    seeder.insert([record])
    return time.monotonic()


def stale_engine_record(engine_id: str, options: OwnershipOptions) -> tuple[str, bytes] | None:
    """The liveness record of an engine without a lock whose heartbeat expired long ago.

    ``None`` when the library keeps no engine records (nothing could call such an engine dead).
    """
    try:
        from weft_sync.liveness import EngineRecord, encode_engine_record
    except ImportError:
        return None
    long_ago = int(time.time() * 1000) - 10 * options.claim_ttl_ms
    record = EngineRecord(
        engine_id=engine_id,
        state="live",
        heartbeat_at=long_ago,
        claim_ttl_ms=options.claim_ttl_ms,
        renew_interval_ms=options.claim_renew_interval_ms,
        held=DEAD_CLAIMS,
        lock=None,
        pid=0,
        host="",
        started_at=long_ago,
    )
    key: str = keys.engine_liveness(engine_id)  # type: ignore[attr-defined]
    return key, encode_engine_record(record)


def _wait_driven(
    survivors: Survivors, ids: list[str], t0: float, options: OwnershipOptions
) -> float | None:
    bound_s = (options.claim_ttl_ms + 3 * options.claim_renew_interval_ms) / 1000 + ALLOWED_S
    wanted = set(ids)
    deadline = t0 + bound_s + 30.0
    while time.monotonic() < deadline:
        events = survivors.drives()
        driven = {wid for _, _, wid in events if wid in wanted}
        if len(driven) == len(wanted):
            return max(at for _, at, wid in events if wid in wanted) - t0
        time.sleep(0.05)
    return None


def _clean_dead(seeder: Seeder, tag: str, dead_engine: str) -> None:
    """Remove every row of a dead run, so the store holds only the other engines' claims."""
    ids = f"dead-{tag}-"
    prefixes = [
        keys.workflow_owner_epoch(ids),
        keys.workflow_owner_holder(ids),
        keys.workflow(ids),
        *(keys.workflow_status_index(s, ids) for s in ("running", "completed", "failed")),
        *(by_engine_key(engine, ids) for engine in (dead_engine, *SURVIVORS)),
    ]
    seeder.delete_prefixes(prefixes)
    if hasattr(keys, "engine_liveness"):
        seeder.delete_keys([keys.engine_liveness(dead_engine)])


def report_dead(backend: str, size: int, runs: list[DeadRun]) -> None:
    options = options_for(None)
    bound_s = (options.claim_ttl_ms + 3 * options.claim_renew_interval_ms) / 1000
    rows = []
    for run in runs:
        within = run.elapsed_s is not None and run.elapsed_s <= bound_s + ALLOWED_S
        rows.append(
            [
                f"{run.scenario}, {run.column}",
                "-" if run.first_s is None else f"{run.first_s * 1000:,.0f} ms",
                "not all" if run.elapsed_s is None else f"{run.elapsed_s * 1000:,.0f} ms",
                *(f"{run.shares[name]:,}" for name in SURVIVORS),
                f"{run.driven:,}/{DEAD_CLAIMS:,}",
                f"{run.held_by_survivors:,}",
                str(run.twice),
                str(run.overruns),
                "yes" if within else "no",
            ]
        )
    print_table(
        f"{backend}: a dead engine's {DEAD_CLAIMS:,} claims among {size:,} live ones, 3 survivor "
        f"processes (bound TTL + 2 x renew + one interval = {bound_s:.0f} s, +{ALLOWED_S:.0f} s)",
        [
            "death, discovery",
            "first driven",
            "all driven",
            *SURVIVORS,
            "driven",
            "held",
            "twice",
            "overruns",
            "in bound",
        ],
        rows,
    )


def dead_modes(include_old: bool) -> dict[str, str | None]:
    """The discoveries the dead-engine case runs: the new one, the old one when asked or alone."""
    found = modes()
    if include_old or "new" not in found:
        return found
    return {"new": found["new"]}


def bench_dead(fleet: Fleet, size: int, scenarios: Sequence[str], include_old: bool) -> None:
    runs: list[DeadRun] = []
    for scenario in scenarios:
        for column, mode in dead_modes(include_old).items():
            tag = f"{scenario}-{column}-{os.getpid()}"
            try:
                runs.append(dead_run(fleet.spec, fleet, scenario, column, mode, tag))
            except SystemExit as exc:
                print(f"{fleet.spec.backend} {scenario}, {column}: {exc}", flush=True)
    report_dead(fleet.spec.backend, size, runs)


# -- worker processes -----------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> None:
    url = os.environ[URL_ENV]
    workdir = Path(args.workdir)
    options = options_for(args.discovery)
    if args.worker == "dead":
        Ownership.open(url, options=options, engine_id=args.name)
        (workdir / f"{args.name}.ready").touch()
        while True:
            time.sleep(60)
    drives = (workdir / f"{args.name}.drives").open("a", buffering=1)
    lock = threading.Lock()  # guards drives (handlers run on several maintenance threads)

    def drive(ctx: ReclaimedWorkflow) -> None:
        line = f"{time.monotonic():.6f} {ctx.workflow_id}\n"
        with lock:
            drives.write(line)

    with Ownership.open(url, options=options, engine_id=args.name, handlers={SEED_TYPE: drive}):
        (workdir / f"{args.name}.ready").touch()
        stop = workdir / "stop"
        while not stop.exists():
            time.sleep(0.05)
    drives.close()


# -- main -----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=sizes_arg, default=None, help="e.g. 10k,100k,1M")
    parser.add_argument("--keep", type=Path, default=None, help="keep (and reuse) stores in DIR")
    parser.add_argument("--drop", action="store_true", help="remove the stores kept in --keep")
    parser.add_argument("--dead", action="store_true", help="add the dead-engine case")
    parser.add_argument("--dead-only", action="store_true", help="only the dead-engine case")
    parser.add_argument(
        "--dead-old", action="store_true", help="the dead-engine case with the old discovery too"
    )
    parser.add_argument("--worker", choices=("survivor", "dead"), help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--discovery", default=None, help=argparse.SUPPRESS)


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
            lines += summarize(backend, bench_backend(fleet, sizes, repeats))
        if manifest is not None:
            manifest["claims"] = seeded_count(Seeder(spec))
            save_manifest(args.keep, backend, manifest)
        if args.dead or args.dead_only:
            bench_dead(fleet, max(sizes), ("crash", "stale"), args.dead_old)
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
    print(f"scale benchmark; {machine_note()}; discoveries: {', '.join(modes())}", flush=True)
    if not HAS_DISCOVERY_OPTION:
        print("the library has no reclaim_discovery option: the new discovery is n/a", flush=True)
    backends = selected_backends(args)
    lines: list[str] = []
    with bench_site(backends) as site:
        for backend in backends:
            if args.keep is not None:
                spec, manifest = kept_store(args.keep, backend, site.pg_url)
                lines += run_backend(backend, spec, args, manifest)
            else:
                lines += run_backend(backend, site.new_store(backend, "scale"), args, None)
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
