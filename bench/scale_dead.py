"""The dead-engine case of ``bench/scale.py``: a dead engine's claims and three survivors.

Survivors and the dead engine are separate processes running ``bench/scale.py --worker``; the
store URL reaches them through the environment (never the command line), and each survivor
appends every drive of its handler, with a ``time.monotonic()`` stamp, to its own file; the
handler then hands the workflow to the survivor's main thread, which keeps driving it (a
``drive()`` block each), as a host running a long job would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import StoreSpec, enter_drive, print_table
from bench.scale_fleet import Discovery, Fleet, heartbeating, modes, options_for
from bench.scale_seed import SEED_TYPE, Seeder
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow, keys
from weft_sync.codec import decode_holder
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record

__all__ = ["bench_dead", "worker_main"]

DEAD_CLAIMS = 10_000
SURVIVORS = ("scale-survivor-1", "scale-survivor-2", "scale-survivor-3")
ALLOWED_S = 3.0
URL_ENV = "WEFT_SCALE_URL"
SCRIPT = Path(__file__).resolve().parent / "scale.py"


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
    role: str, name: str, workdir: Path, spec: StoreSpec, mode: Discovery
) -> subprocess.Popen[bytes]:
    """Run this script as a ``role`` worker; the store URL goes by environment, never argv."""
    env = {**os.environ, URL_ENV: spec.url, "PYTHONPATH": str(SCRIPT.parent.parent)}
    command = [sys.executable, str(SCRIPT), "--worker", role, "--name", name]
    command += ["--workdir", str(workdir), "--discovery", mode]
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

    def __init__(self, spec: StoreSpec, workdir: Path, mode: Discovery) -> None:
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


def dead_run(
    spec: StoreSpec, fleet: Fleet, scenario: str, column: str, mode: Discovery, tag: str
) -> DeadRun:
    seeder = Seeder(spec)
    ids = [f"dead-{tag}-{n:05d}" for n in range(DEAD_CLAIMS)]
    dead_engine = f"scale-dead-{tag}"
    options = options_for(mode)
    with tempfile.TemporaryDirectory(prefix="weft-scale-") as tmp:
        workdir = Path(tmp)
        with heartbeating(fleet):
            survivors = Survivors(spec, workdir, mode)
            try:
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
    mode: Discovery,
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
    long_ago = int(time.time() * 1000) - 10 * options.claim_ttl_ms
    seeder.seed_claims(
        ids, [dead_engine], expires_at=long_ago + options.claim_ttl_ms, claimed_at=long_ago
    )
    seeder.insert([record])
    return time.monotonic()


def stale_engine_record(engine_id: str, options: OwnershipOptions) -> tuple[str, bytes]:
    """The liveness record of an engine without a lock whose heartbeat expired long ago."""
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
    return keys.engine_liveness(engine_id), encode_engine_record(record)


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
        *(keys.workflow_owner_by_engine(engine, ids) for engine in (dead_engine, *SURVIVORS)),
    ]
    seeder.delete_prefixes(prefixes)
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


def dead_modes(include_old: bool) -> dict[str, Discovery]:
    """The discoveries the dead-engine case runs: the new one, and the old one when asked."""
    found = modes()
    return found if include_old else {"new": found["new"]}


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
    lock = threading.Lock()  # guards drives (handlers run on several handler threads)
    handed: queue.Queue[str] = queue.Queue()

    def drive(ctx: ReclaimedWorkflow) -> None:
        line = f"{time.monotonic():.6f} {ctx.workflow_id}\n"
        with lock:
            drives.write(line)
        handed.put(ctx.workflow_id)  # the main thread drives it from here on

    # The main thread's drive blocks are entered before the engine opens, so they end after its
    # close released the claims: none is left unfinished.
    with (
        contextlib.ExitStack() as driving,
        Ownership.open(
            url, options=options, engine_id=args.name, handlers={SEED_TYPE: drive}
        ) as ownership,
    ):
        (workdir / f"{args.name}.ready").touch()
        stop = workdir / "stop"
        pending: list[str] = []
        while not stop.exists():
            with contextlib.suppress(queue.Empty):
                while True:
                    pending.append(handed.get_nowait())
            pending = [wid for wid in pending if not enter_drive(ownership, driving, wid)]
            time.sleep(0.05)
    drives.close()
