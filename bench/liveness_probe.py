"""Session-lock probes: one probe round for 1 / 8 / 64 engines, and SIGKILL to ``on_dead``.

Part 1 holds E session locks (E = 1, 8, 64) and times one ``probe_session_locks`` probe of all
of them by their published identities (what the liveness watcher does every 50 ms) and one
``survey_engines`` (one scan of the engine records plus that probe, what it does every second),
against a floor measured in the same run: SQLite, a bare ``open`` + ``flock(LOCK_SH|LOCK_NB)``
+ ``close`` loop over the same files; PostgreSQL, one ``SELECT 1`` round trip on a pooled
connection.

Part 2 spawns an engine process (``EngineLiveness`` with its session lock), waits until a
``LivenessWatcher`` (poll 50 ms, refresh 1 s) in this process watches it, sends SIGKILL and
times the kill until ``on_dead`` runs; median and max over the rounds (10; ``--quick``: 3).

    python bench/liveness_probe.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import fcntl
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    StoreSpec,
    bench_site,
    interleave,
    machine_note,
    median,
    ms,
    parse_args,
    print_table,
    ratio,
    selected_backends,
)
from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.reclaim.engine_liveness import EngineLiveness
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.verdicts import survey_engines
from weft_sync.reclaim.watcher import LivenessWatcher
from weft_sync.storage import Storage, open_storage
from weft_sync.storage.session_locks import LockState, SessionLock, storage_session_locks
from weft_sync.storage.sqlite.locks import lock_directory

ENGINE_COUNTS = (1, 8, 64)
POLL_MS = 50
REFRESH_MS = 1000
GIVE_UP_S = 30.0


def _engine_record(engine_id: str, lock_id: str) -> EngineRecord:
    now = system_clock()
    return EngineRecord(
        engine_id, "live", now, 30_000, 5_000, 0, engine_id, os.getpid(), "", now, lock_id=lock_id
    )


def _survey(storage: Storage) -> None:
    survey_engines(storage, now=system_clock())


def _sqlite_floor(spec: StoreSpec, names: list[str]) -> Any:
    assert spec.path is not None
    paths = [os.path.join(lock_directory(spec.path), f"{name}.lock") for name in names]

    def probe() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    return probe


def _postgres_floor(storage: Storage) -> Any:
    def probe() -> None:
        with storage._connection("bench", check=False) as conn:  # type: ignore[attr-defined]
            conn.execute("SELECT 1").fetchall()

    return probe


def probe_costs(spec: StoreSpec, repeats: int) -> list[list[object]]:
    rows: list[list[object]] = []
    with spec.open() as storage:
        locks = storage_session_locks(storage)
        assert locks is not None
        for count in ENGINE_COUNTS:
            names = [f"engine-{n:03d}" for n in range(count)]
            held: list[SessionLock] = [locks.acquire_session_lock(name) for name in names]
            try:
                identities = {lock.name: lock.identity for lock in held}
                for name in names:
                    record = _engine_record(name, identities[name])
                    storage.put(keys.engine_liveness(name), encode_engine_record(record))
                assert set(locks.probe_session_locks(identities).values()) == {LockState.HELD}
                floor = (
                    _sqlite_floor(spec, names)
                    if spec.backend == "sqlite"
                    else _postgres_floor(storage)
                )
                samples = interleave(
                    {
                        "probe": functools.partial(locks.probe_session_locks, identities),
                        "survey": functools.partial(_survey, storage),
                        "floor": floor,
                    },
                    repeats,
                )
            finally:
                for lock in held:
                    lock.release()
                for name in names:
                    storage.delete(keys.engine_liveness(name))
            probe, survey, base = (samples[k].median_wall for k in ("probe", "survey", "floor"))
            rows.append(
                [
                    spec.backend,
                    count,
                    ms(probe),
                    ms(survey),
                    ms(base),
                    ratio(probe, base),
                    ratio(survey, base),
                ]
            )
    return rows


def _engine_main(url: str, engine_id: str, ready: Any) -> None:
    storage = open_storage(url)
    liveness = EngineLiveness(
        storage,
        engine_id=engine_id,
        clock=system_clock,
        claim_ttl_ms=30_000,
        renew_interval_ms=5_000,
    )
    liveness.start()
    ready.set()
    time.sleep(3600)


class _DeadStamp:
    """An ``on_dead`` that notes when each engine was first reported."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.seen = threading.Event()

    def __call__(self, engine_id: str) -> None:
        self.at.setdefault(engine_id, time.monotonic())
        self.seen.set()


def kill_latency(spec: StoreSpec, rounds: int) -> list[object]:
    ctx = multiprocessing.get_context("spawn")
    latencies: list[float] = []
    with spec.open() as storage:
        for n in range(rounds):
            engine_id = f"victim-{n}"
            on_dead = _DeadStamp()
            ready = ctx.Event()
            proc = ctx.Process(target=_engine_main, args=(spec.url, engine_id, ready), daemon=True)
            proc.start()
            watcher = LivenessWatcher(
                storage,
                engine_id="bench-survivor",
                on_dead=on_dead,
                poll_ms=POLL_MS,
                refresh_ms=REFRESH_MS,
                clock=system_clock,
            )
            try:
                if not ready.wait(GIVE_UP_S):
                    raise RuntimeError("the engine process did not start")
                watcher.start()
                deadline = time.monotonic() + GIVE_UP_S
                while engine_id not in watcher.watched():
                    if time.monotonic() > deadline:
                        raise RuntimeError("the watcher never saw the engine")
                    time.sleep(0.01)
                time.sleep(0.2)  # let the poll phase settle so the kill lands at a random point
                killed_at = time.monotonic()
                assert proc.pid is not None
                os.kill(proc.pid, signal.SIGKILL)
                if not on_dead.seen.wait(GIVE_UP_S):
                    raise RuntimeError("on_dead was not called")
                latencies.append(on_dead.at[engine_id] - killed_at)
            finally:
                watcher.close()
                if proc.is_alive():
                    proc.kill()
                proc.join(GIVE_UP_S)
                storage.delete(keys.engine_liveness(engine_id))
    return [
        spec.backend,
        len(latencies),
        ms(median(latencies)),
        ms(max(latencies)),
        ratio(median(latencies), POLL_MS / 1000),
    ]


def main() -> None:
    args = parse_args(__doc__)
    repeats = args.repeats or (5 if args.quick else 30)
    rounds = args.repeats or (3 if args.quick else 10)
    backends = selected_backends(args)
    print(machine_note())
    probe_rows: list[list[object]] = []
    kill_rows: list[list[object]] = []
    with bench_site(backends) as site:
        for backend in backends:
            probe_rows.extend(probe_costs(site.new_store(backend, "probe"), repeats))
            kill_rows.append(kill_latency(site.new_store(backend, "kill"), rounds))
    print_table(
        f"One probe round / one survey, median of {repeats} (floor: see the docstring)",
        ["backend", "engines", "probe", "survey", "floor", "probe/floor", "survey/floor"],
        probe_rows,
    )
    print_table(
        f"SIGKILL of an engine until on_dead (watcher poll {POLL_MS} ms)",
        ["backend", "rounds", "median", "max", "median/poll"],
        kill_rows,
    )


if __name__ == "__main__":
    main()
