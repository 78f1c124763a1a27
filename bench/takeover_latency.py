"""Takeover latency: from SIGKILL (or SIGSTOP) of an owner to survivors driving its workflows.

Four rows per backend, each from fresh stores, medians and maxima over the runs (5;
``--quick``: 2):

``SIGKILL, 1 survivor`` / ``SIGKILL, 3 survivors``
    An owner process opens a real ``Ownership`` with the default options (TTL 30 s, renew
    interval 5 s, ``background="thread"``), starts 500 workflows (``--quick``: 100) of type
    ``job`` and signals ready. Survivor processes (one, or three) open an ``Ownership`` with the
    same defaults and a ``job`` handler that stamps ``time.monotonic()`` (one clock for every
    process on the host) per workflow id; the handler runs only after the takeover. Once the
    survivors have watched the owner for a while it gets SIGKILL. Measured from the kill: the
    first and the last stamp. Target: all driven within 250 ms, independent of the TTL (its
    session lock goes with the process, the survivors' liveness watchers see it at their next
    50 ms probe and run a reclaim pass at once). Checked after each run: every holder names a
    survivor at epoch 2, and how many were taken before the owner's holders expired (proof that
    the crash was seen, not waited out).
``SIGSTOP, 1 survivor``
    The same, but the owner is frozen, not killed: it keeps its session lock, so it must be taken
    over only once its claims expire (the last renewed expiry + 2 x renew interval of grace).
    Checked per workflow: the new holder's ``claimed_at`` is past the old holder's ``expires_at``
    + 2 x renew interval (read after the stop). Expected from the stop: between TTL + 1 and
    TTL + 3 renew intervals. The defaults make that 35-45 s per run; ``--stop-ttl 3s/1s`` uses a
    shorter TTL / renew interval for this row only, as ``--quick`` does with 3 s / 1 s (the output
    says so). The owner gets SIGCONT and then SIGKILL afterwards.
``SIGKILL, short TTL``
    The earlier benchmark: a bare bootstrap engine (no session lock, no handlers) holding claims
    with TTL 900 ms, renew 300 ms, against ``TTL + 2 x renew interval + one interval``.

    python bench/takeover_latency.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--claims N] [--stop-ttl TTL/RENEW] [--stop-repeats N] [--rows kill1,kill3,stop1,short]
        [--log-dir DIR]

``--log-dir`` writes each survivor's log (INFO: lock seen gone, entries read, each takeover) to
``DIR/<backend>-<scenario>-<run>-<survivor>.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Site,
    StoreSpec,
    bench_site,
    hold_claims,
    machine_note,
    parse_args,
    print_table,
    running_workflow_ops,
    selected_backends,
    workflow_ids,
    write_in_chunks,
)
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow, keys
from weft_sync.clock import system_clock
from weft_sync.codec import HolderRecord, decode_holder
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.options import parse_duration
from weft_sync.storage import Storage, open_storage

JOB = "job"
TARGET_S = 0.250
OBSERVE_S = 2.0
"""How long survivors watch the owner before the signal: past one survey of engine records (1 s)."""
START_S = 120.0
SETTLE_S = 0.3
"""After SIGSTOP, before the owner's last holders are read: a commit in flight lands first."""
DEFAULTS = OwnershipOptions()
ROWS = ("kill1", "kill3", "stop1", "short")
ONE = ("survivor-1",)
THREE = ("survivor-1", "survivor-2", "survivor-3")


@dataclass(frozen=True)
class Timing:
    """Claim timing of one scenario (owner and survivors alike)."""

    ttl_ms: int
    renew_ms: int

    def options(self) -> OwnershipOptions:
        return OwnershipOptions(claim_ttl=self.ttl_ms, claim_renew_interval=self.renew_ms)

    @property
    def label(self) -> str:
        return f"TTL {self.ttl_ms / 1000:g} s, renew {self.renew_ms / 1000:g} s"


DEFAULT_TIMING = Timing(DEFAULTS.claim_ttl_ms, DEFAULTS.claim_renew_interval_ms)
QUICK_STOP_TIMING = Timing(3_000, 1_000)
"""The SIGSTOP row's timing with ``--quick`` (the defaults make it wait ~40 s a run)."""


# -- processes ------------------------------------------------------------------------------


def _owner_main(url: str, count: int, timing: Timing, ready: Any) -> None:
    """Start and drive ``count`` running ``job`` workflows, signal ``ready``, idle until killed.

    The main thread drives every workflow (one ``drive()`` block each, left open): a claim
    held with nobody driving it would be released one renew interval after its start.
    """
    ownership = Ownership.open(url, options=timing.options(), engine_id="owner")
    with contextlib.ExitStack() as drives:
        for wid in workflow_ids(count, prefix=JOB):
            ownership.workflows.start(wid, JOB)
            drives.enter_context(ownership.workflows.drive(wid))
        ready.set()
        while True:
            time.sleep(60)


def _survivor_main(
    url: str, name: str, timing: Timing, ready: Any, stop: Any, driven: Any, log: str | None
) -> None:
    """Drive ``job`` workflows, reporting (name, id, epoch, monotonic stamp), until ``stop``."""
    if log is not None:
        logging.basicConfig(
            filename=log,
            format="%(created).3f %(threadName)s %(name)s %(levelname)s %(message)s",
            level=logging.INFO,
        )

    def drive(ctx: ReclaimedWorkflow) -> None:
        driven.put((name, ctx.workflow_id, ctx.epoch, time.monotonic()))

    with Ownership.open(url, options=timing.options(), engine_id=name, handlers={JOB: drive}):
        ready.set()
        stop.wait(START_S * 3)


@dataclass
class Fleet:
    """An owner process and survivor processes on one store."""

    spec: StoreSpec
    timing: Timing
    count: int
    survivors: tuple[str, ...]
    log_prefix: str | None
    ctx: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    owner: Any = None
    procs: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop = self.ctx.Event()
        self.driven = self.ctx.Queue()

    def start(self) -> None:
        ready = self.ctx.Event()
        self.owner = self.ctx.Process(
            target=_owner_main, args=(self.spec.url, self.count, self.timing, ready), name="owner"
        )
        self.owner.start()
        if not ready.wait(START_S):
            raise SystemExit("the owner process did not start")
        readies = []
        for name in self.survivors:
            ready = self.ctx.Event()
            log = None if self.log_prefix is None else f"{self.log_prefix}-{name}.log"
            args = (self.spec.url, name, self.timing, ready, self.stop, self.driven, log)
            proc = self.ctx.Process(target=_survivor_main, args=args, name=name)
            proc.start()
            self.procs.append(proc)
            readies.append(ready)
        if not all(r.wait(START_S) for r in readies):
            raise SystemExit("a survivor process did not start")
        time.sleep(OBSERVE_S)
        if not self.driven.empty():
            raise SystemExit("a survivor took over live claims: the owner is too slow")

    def collect(self, give_up_s: float) -> dict[str, tuple[str, int, float]]:
        """Wait until every workflow was driven; return id -> (survivor, epoch, first stamp)."""
        first: dict[str, tuple[str, int, float]] = {}
        deadline = time.monotonic() + give_up_s
        while len(first) < self.count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(
                    f"only {len(first)} of {self.count} workflows were driven {give_up_s:.0f} s "
                    "after the signal"
                )
            with contextlib.suppress(queue.Empty):
                name, wid, epoch, at = self.driven.get(timeout=min(left, 0.2))
                if wid in first:
                    raise SystemExit(f"{wid} was driven twice ({first[wid][0]}, then {name})")
                first[wid] = (name, epoch, at)
        return first

    def close(self) -> None:
        self.stop.set()
        if self.owner is not None and self.owner.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.owner.pid, signal.SIGCONT)
            self.owner.kill()
        if self.owner is not None:
            self.owner.join(30)
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(30)


def _holders(storage: Storage, ids: Sequence[str]) -> dict[str, HolderRecord]:
    found = {}
    for wid in ids:
        holder = decode_holder(storage.get(keys.workflow_owner_holder(wid)))
        if holder is None:
            raise SystemExit(f"{wid} has no readable holder")
        found[wid] = holder
    return found


# -- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What one run measured, from the signal."""

    first_s: float
    last_s: float
    shares: Counter[str]
    early: int
    """SIGKILL: taken before the old holder expired. SIGSTOP: taken before expiry + grace."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the signal to each logged step (with ``--log-dir``): see :data:`PHASES`."""


PHASES = {
    "lock seen gone": "lost its session lock: reported dead",
    "dead engine's entries read": "dead engines found",
    "first takeover committed": "took over workflow",
}


def log_phases(paths: Sequence[str], since_wall: float) -> dict[str, float]:
    """Seconds from ``since_wall`` to each step's first log line (any survivor), and the last
    takeover; from the ``%(created)`` stamps the survivors log with ``--log-dir``."""
    firsts: dict[str, float] = {}
    last_takeover = None
    for path in paths:
        with open(path, encoding="utf-8") as log:
            for line in log:
                stamp, _, text = line.partition(" ")
                try:
                    at = float(stamp) - since_wall
                except ValueError:
                    continue
                if at < 0:
                    continue
                for phase, marker in PHASES.items():
                    if marker in text and at < firsts.get(phase, float("inf")):
                        firsts[phase] = at
                if PHASES["first takeover committed"] in text:
                    last_takeover = max(at, last_takeover or at)
    if last_takeover is not None:
        firsts["last takeover committed"] = last_takeover
    return firsts


def fleet_run(
    spec: StoreSpec,
    timing: Timing,
    count: int,
    survivors: tuple[str, ...],
    signum: int,
    log_prefix: str | None,
) -> Run:
    """Signal an owner of ``count`` workflows among ``survivors``; measure and check takeover."""
    ids = workflow_ids(count, prefix=JOB)
    fleet = Fleet(spec, timing, count, survivors, log_prefix)
    grace_ms = 2 * timing.renew_ms
    give_up_s = (timing.ttl_ms + 4 * timing.renew_ms) / 1000 + 30
    with contextlib.closing(spec.open()) as storage:
        try:
            fleet.start()
            before = _holders(storage, ids)
            if {h.engine_id for h in before.values()} != {"owner"}:
                raise SystemExit("the owner does not hold all its workflows before the signal")
            signalled_wall, signalled_at = time.time(), time.monotonic()
            os.kill(fleet.owner.pid, signum)
            if signum == signal.SIGSTOP:
                time.sleep(SETTLE_S)
                before = _holders(storage, ids)
            first = fleet.collect(give_up_s)
            after = _holders(storage, ids)
        finally:
            fleet.close()
    for wid, (name, epoch, _) in first.items():
        held = (after[wid].engine_id, after[wid].epoch)
        if held != (name, epoch) or epoch != before[wid].epoch + 1:
            raise SystemExit(f"{wid}: driven by {name} at {epoch}, held as {after[wid]}")
    if signum == signal.SIGKILL:
        early = sum(after[w].claimed_at < before[w].expires_at for w in ids)
    else:
        early = sum(after[w].claimed_at <= before[w].expires_at + grace_ms for w in ids)
    stamps = sorted(at for _, _, at in first.values())
    logs = [] if log_prefix is None else [f"{log_prefix}-{name}.log" for name in survivors]
    return Run(
        stamps[0] - signalled_at,
        stamps[-1] - signalled_at,
        Counter(name for name, _, _ in first.values()),
        early,
        log_phases(logs, signalled_wall),
    )


# -- the short-TTL row (bare bootstrap engine, no session lock) ------------------------------

SHORT_TTL_MS = 900
SHORT_RENEW_MS = 300
SHORT_BOUND_S = (SHORT_TTL_MS + 3 * SHORT_RENEW_MS) / 1000


def _short_owner_main(url: str, ids: list[str], ready: Any) -> None:
    """Hold a claim on every id with interval renewal, signal ``ready``, idle until killed."""
    storage = open_storage(url)
    ownership = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=system_clock,
        claim_ttl_ms=SHORT_TTL_MS,
        claim_renew_interval_ms=SHORT_RENEW_MS,
        engine_id="owner",
    )
    hold_claims(ownership.registry, storage, ids, ttl_ms=SHORT_TTL_MS)
    ownership.renewal_task.start()
    ready.set()
    while True:
        time.sleep(60)


class DriveStamps:
    """The survivor's drive callback: the monotonic time each workflow was first driven."""

    def __init__(self, expected: int) -> None:
        # _lock guards stamps.
        self._lock = threading.Lock()
        self.stamps: dict[str, float] = {}
        self.expected = expected
        self.all_driven = threading.Event()

    def __call__(self, workflow_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.stamps.setdefault(workflow_id, now)
            if len(self.stamps) >= self.expected:
                self.all_driven.set()


def short_ttl_run(spec: StoreSpec, claims: int) -> tuple[float, float]:
    """Kill a bare owner of ``claims`` claims; return (first, last) takeover latency in seconds."""
    ids = workflow_ids(claims)
    with contextlib.closing(spec.open()) as storage:
        now = system_clock()
        write_in_chunks(storage, [op for wid in ids for op in running_workflow_ops(wid, now)])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    owner = ctx.Process(target=_short_owner_main, args=(spec.url, ids, ready), name="bench-owner")
    owner.start()
    try:
        if not ready.wait(START_S):
            raise SystemExit("the owner process did not start")
        stamps = DriveStamps(claims)
        with contextlib.closing(spec.open()) as storage:
            survivor = bootstrap_workflow_lease_ownership(
                storage=storage,
                clock=system_clock,
                claim_ttl_ms=SHORT_TTL_MS,
                claim_renew_interval_ms=SHORT_RENEW_MS,
                engine_id="survivor",
                on_workflow_claim_reclaimed=stamps,
            )
            survivor.renewal_task.start()
            try:
                time.sleep(1.0)
                if stamps.stamps:
                    raise SystemExit("the survivor took over live claims: the owner is too slow")
                killed_at = time.monotonic()
                os.kill(owner.pid or 0, signal.SIGKILL)
                if not stamps.all_driven.wait(20.0):
                    raise SystemExit(
                        f"only {len(stamps.stamps)} of {claims} claims were taken over "
                        "20 s after the kill"
                    )
            finally:
                survivor.renewal_task.close(timeout=30)
    finally:
        if owner.is_alive():
            os.kill(owner.pid or 0, signal.SIGKILL)
        owner.join(timeout=30)
    times = sorted(stamps.stamps.values())
    return times[0] - killed_at, times[-1] - killed_at


# -- tables ---------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _row(name: str, firsts: list[float], lasts: list[float], target: str, ok: bool) -> list[str]:
    return [
        name,
        _ms(statistics.median(firsts)),
        _ms(max(firsts)),
        _ms(statistics.median(lasts)),
        _ms(max(lasts)),
        target,
        "met" if ok else "MISSED",
    ]


@dataclass(frozen=True)
class Plan:
    """What to run on each backend."""

    claims: int
    runs: int
    stop_runs: int
    stop_timing: Timing
    log_dir: str | None
    rows: frozenset[str] = frozenset(ROWS)


def _scenario(
    site: Site, backend: str, plan: Plan, label: str, survivors: tuple[str, ...], signum: int
) -> list[Run]:
    timing = plan.stop_timing if signum == signal.SIGSTOP else DEFAULT_TIMING
    runs = []
    for n in range(plan.stop_runs if signum == signal.SIGSTOP else plan.runs):
        prefix = None
        if plan.log_dir is not None:
            prefix = str(Path(plan.log_dir) / f"{backend}-{label}-{n + 1}")
        spec = site.new_store(backend, name="takeover")
        runs.append(fleet_run(spec, timing, plan.claims, survivors, signum, prefix))
    return runs


def bench_backend(site: Site, backend: str, plan: Plan) -> None:
    n, st = plan.claims, plan.stop_timing
    lo_s, hi_s = (st.ttl_ms + st.renew_ms) / 1000, (st.ttl_ms + 3 * st.renew_ms) / 1000
    rows: list[list[str]] = []
    fleets: list[tuple[str, tuple[str, ...], list[Run]]] = []
    kill_lasts: list[float] = []
    for key, label, survivors, signum in (
        ("kill1", "SIGKILL, 1 survivor", ONE, signal.SIGKILL),
        ("kill3", "SIGKILL, 3 survivors", THREE, signal.SIGKILL),
        ("stop1", "SIGSTOP, 1 survivor", ONE, signal.SIGSTOP),
    ):
        if key not in plan.rows:
            continue
        runs = _scenario(site, backend, plan, key, survivors, signum)
        fleets.append((label, survivors, runs))
        firsts, lasts = [r.first_s for r in runs], [r.last_s for r in runs]
        if signum == signal.SIGKILL:
            kill_lasts += lasts
            target, ok = "<= 250 ms", max(lasts) <= TARGET_S
        else:
            target, ok = f"{lo_s:g}-{hi_s:g} s", lo_s <= min(firsts) and max(lasts) <= hi_s
        timing = st if signum == signal.SIGSTOP else DEFAULT_TIMING
        rows.append(_row(f"{label} ({timing.label})", firsts, lasts, target, ok))
    if "short" in plan.rows:
        short = [short_ttl_run(site.new_store(backend, name="short"), n) for _ in range(plan.runs)]
        label = f"SIGKILL, short TTL (TTL {SHORT_TTL_MS} ms, renew {SHORT_RENEW_MS} ms, no lock)"
        worst = max(last for _, last in short)
        bound = f"<= {SHORT_BOUND_S * 1000:,.0f} ms"
        rows.append(
            _row(label, [f for f, _ in short], [x for _, x in short], bound, worst <= SHORT_BOUND_S)
        )
    print_table(
        f"{backend}: {n:,} workflows of an owner, from the signal to the survivors driving them "
        f"({plan.runs} runs; SIGSTOP {plan.stop_runs})",
        ["scenario", "first median", "first max", f"all {n:,} median", "all max", "target", ""],
        rows,
    )
    _print_checks(backend, n, fleets)
    _print_phases(backend, n, [(label, runs) for label, _, runs in fleets if "KILL" in label])
    if kill_lasts:
        ratios = [last / TARGET_S for last in kill_lasts]
        print(
            f"SIGKILL, all driven / 250 ms target: median {statistics.median(ratios):.2f}x, "
            f"worst {max(ratios):.2f}x."
        )
    stops = [r for label, _, runs in fleets if "STOP" in label for r in runs]
    if stops:
        print(
            f"A SIGSTOPped owner's workflows taken before expiry + grace: "
            f"{sum(r.early for r in stops)} of {n * len(stops)} (must be 0)."
        )


def _print_checks(
    backend: str, n: int, fleets: Sequence[tuple[str, tuple[str, ...], list[Run]]]
) -> None:
    """Per run: the survivors' shares and the expiry checks."""
    rows = []
    for label, names, runs in fleets:
        for i, r in enumerate(runs):
            killed = label.startswith("SIGKILL")
            rows.append(
                [
                    label,
                    str(i + 1),
                    _ms(r.last_s),
                    " / ".join(str(r.shares[name]) for name in names),
                    f"{r.early}/{n}" if killed else "-",
                    "-" if killed else f"{r.early}/{n}",
                ]
            )
    if rows:
        print_table(
            f"{backend}: checks per run",
            ["scenario", "run", "all driven", "shares", "before expiry", "before expiry + grace"],
            rows,
        )


def _print_phases(backend: str, n: int, scenarios: Sequence[tuple[str, list[Run]]]) -> None:
    """Where the time goes after SIGKILL, from the survivors' logs (medians over the runs)."""
    steps = [*PHASES, "last takeover committed"]
    rows = []
    for label, runs in scenarios:
        logged = [r for r in runs if r.phases]
        if not logged:
            continue
        cells = []
        for step in steps:
            values = [r.phases[step] for r in logged if step in r.phases]
            cells.append(_ms(statistics.median(values)) if values else "-")
        cells.append(_ms(statistics.median(r.first_s for r in logged)))
        cells.append(_ms(statistics.median(r.last_s for r in logged)))
        rows.append([label, *cells])
    if rows:
        print_table(
            f"{backend}: where the time goes after SIGKILL (median ms from the kill, from logs)",
            ["scenario", *steps, "first handler", f"all {n:,} handlers"],
            rows,
        )


def _stop_timing(value: str) -> Timing:
    ttl, _, renew = value.partition("/")
    try:
        ttl_ms = parse_duration(ttl)
        renew_ms = parse_duration(renew) if renew else max(1, ttl_ms // 6)
        OwnershipOptions(claim_ttl=ttl_ms, claim_renew_interval=renew_ms)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"--stop-ttl wants TTL[/RENEW] such as 3s/1s, got {value!r}: {exc}"
        ) from exc
    return Timing(ttl_ms, renew_ms)


def _rows(value: str) -> tuple[str, ...]:
    rows = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [row for row in rows if row not in ROWS]
    if unknown or not rows:
        raise argparse.ArgumentTypeError(
            f"--rows wants a comma-separated list of {', '.join(ROWS)}, got {value!r}"
        )
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=None, help="workflows the owner holds")
    parser.add_argument(
        "--stop-ttl",
        type=_stop_timing,
        default=None,
        help="TTL[/RENEW] of the SIGSTOP row (default: the library defaults, 30s/5s; "
        "with --quick 3s/1s)",
    )
    parser.add_argument("--stop-repeats", type=int, default=None, help="runs of the SIGSTOP row")
    parser.add_argument(
        "--rows",
        type=_rows,
        default=ROWS,
        help=f"comma-separated rows to run, of {','.join(ROWS)} (default: all)",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="write survivors' INFO logs here and print where the time goes",
    )


def main() -> None:
    args = parse_args(__doc__, configure)
    runs = args.repeats or (2 if args.quick else 5)
    plan = Plan(
        claims=args.claims or (100 if args.quick else 500),
        runs=runs,
        stop_runs=args.stop_repeats or runs,
        stop_timing=args.stop_ttl or (QUICK_STOP_TIMING if args.quick else DEFAULT_TIMING),
        log_dir=args.log_dir,
        rows=frozenset(args.rows),
    )
    print(f"takeover latency benchmark; {machine_note()}")
    if plan.stop_timing != DEFAULT_TIMING:
        print(f"the SIGSTOP row uses {plan.stop_timing.label} (not the defaults)")
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            bench_backend(site, backend, plan)


if __name__ == "__main__":
    main()
