"""Acquire + release cycles per second: the registry, a hand-written raw floor and a peer lock.

One cycle is ``registry.acquire(id)`` then ``registry.release(id)`` on an id only this worker
uses. Workers run for a fixed time in three layouts: 1 thread, 16 threads sharing one registry
and store, and 4 processes (one registry each). Variants, measured in the same run:

- ``library``: ``ClaimRegistry`` over ``SqliteStorage`` / ``PostgresStorage`` (the acquire reads
  the holder and epoch, then commits one CAS; the release commits one CAS);
- ``raw``: the same conditions, puts and deletes written by hand against the driver, one
  transaction each. SQLite: ``BEGIN IMMEDIATE``, SELECT holder (absent) and epoch, REPLACE epoch
  + 1 and holder, COMMIT; release: SELECT epoch and holder (ours), DELETE holder, COMMIT; one
  connection per worker. ``raw, one conn`` (threads only): one connection behind a
  ``threading.Lock``. PostgreSQL: the row-locking SELECT … FOR UPDATE, an INSERT … ON CONFLICT DO
  NOTHING for the absent holder and an upsert of the epoch; release locks, compares, deletes.
  The floor is the faster raw variant of each layout;
- ``tooz file`` (peer, SQLite table only): tooz's file driver, ``get_lock(name)`` then
  ``acquire(blocking=False)`` + ``release()``; fcntl locks, nothing durable and no fencing token.

Target (SQLite): library overhead at most 2x the floor in every layout.

    python bench/acquire_release.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--seconds S]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack

from bench.common import (
    TTL_MS,
    Site,
    StoreSpec,
    bench_site,
    machine_note,
    new_registry,
    parse_args,
    print_table,
    ratio,
    selected_backends,
)
from weft_sync import keys
from weft_sync.clock import system_clock

IDS_PER_WORKER = 8
LAYOUTS = (("1 thread", 1, 1), ("16 threads", 1, 16), ("4 processes", 4, 1))
FLOOR_TARGET = 2.0
Cycle = Callable[[], None]


class Context(Protocol):
    def cycle_for(self, worker: int) -> Cycle: ...

    def close(self) -> None: ...


def _claim_keys(worker: int) -> list[tuple[str, str]]:
    ids = [f"w{worker:03d}-{n}" for n in range(IDS_PER_WORKER)]
    return [(keys.workflow_owner_epoch(w), keys.workflow_owner_holder(w)) for w in ids]


def _holder_bytes(engine_id: str, epoch: int) -> bytes:
    now = system_clock()
    record = {"engine_id": engine_id, "epoch": epoch, "expires_at": now + TTL_MS, "claimed_at": now}
    packed: bytes = msgpack.packb(record, use_bin_type=True)
    return packed


class LibraryContext:
    """One store and one registry per process, shared by its threads."""

    def __init__(self, spec: StoreSpec) -> None:
        self.storage = spec.open()
        self.registry = new_registry(self.storage, engine_id=f"engine-{os.getpid()}")

    def cycle_for(self, worker: int) -> Cycle:
        ids = itertools.cycle([f"w{worker:03d}-{n}" for n in range(IDS_PER_WORKER)])
        registry = self.registry

        def cycle() -> None:
            wid = next(ids)
            acquired = registry.acquire(wid)
            if acquired.status != "acquired":
                raise RuntimeError(f"acquire of {wid} gave {acquired}")
            released = registry.release(wid)
            if released.status != "released":
                raise RuntimeError(f"release of {wid} gave {released}")

        return cycle

    def close(self) -> None:
        self.storage.close()


class RawSqliteContext:
    """Hand-written SQLite claims: a connection per worker, or one shared behind a lock."""

    def __init__(self, spec: StoreSpec, *, shared: bool) -> None:
        self.spec = spec
        self.engine_id = f"raw-{os.getpid()}"
        self.lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if shared else contextlib.nullcontext()
        )
        self.shared = spec.raw_sqlite() if shared else None
        self.connections: list[Any] = []
        table = f'"{spec.table}"'
        self.select = f"SELECT value FROM {table} WHERE key = ?"
        self.put = f"REPLACE INTO {table} (key, value) VALUES (?, ?)"
        self.delete = f"DELETE FROM {table} WHERE key = ?"

    def cycle_for(self, worker: int) -> Cycle:
        conn = self.shared
        if conn is None:
            conn = self.spec.raw_sqlite()
            self.connections.append(conn)
        claims = itertools.cycle(_claim_keys(worker))
        lock, select, put, delete = self.lock, self.select, self.put, self.delete

        def cycle() -> None:
            epoch_key, holder_key = next(claims)
            with lock:
                conn.execute("BEGIN IMMEDIATE")
                if conn.execute(select, (holder_key,)).fetchone() is not None:
                    conn.execute("ROLLBACK")
                    raise RuntimeError(f"{holder_key} is held")
                row = conn.execute(select, (epoch_key,)).fetchone()
                epoch = (0 if row is None else int.from_bytes(row[0], "big")) + 1
                epoch_bytes = epoch.to_bytes(8, "big")
                holder = _holder_bytes(self.engine_id, epoch)
                conn.execute(put, (epoch_key, epoch_bytes))
                conn.execute(put, (holder_key, holder))
                conn.execute("COMMIT")
            with lock:
                conn.execute("BEGIN IMMEDIATE")
                mine = conn.execute(select, (epoch_key,)).fetchone() == (epoch_bytes,)
                if not mine or conn.execute(select, (holder_key,)).fetchone() != (holder,):
                    conn.execute("ROLLBACK")
                    raise RuntimeError(f"{holder_key} moved on")
                conn.execute(delete, (holder_key,))
                conn.execute("COMMIT")

        return cycle

    def close(self) -> None:
        for conn in [*self.connections, self.shared]:
            if conn is not None:
                conn.close()


class RawPostgresContext:
    """Hand-written PostgreSQL claims, one autocommit connection per worker."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.engine_id = f"raw-{os.getpid()}"
        self.connections: list[Any] = []
        table = f'"{spec.table}"'
        self.lock_rows = (
            f"SELECT key, value FROM {table} WHERE key = ANY(%s) ORDER BY key FOR UPDATE"
        )
        self.insert_absent = (
            f"INSERT INTO {table} (key, value) VALUES (%s, %b) ON CONFLICT (key) DO NOTHING"
        )
        self.upsert = (
            f"INSERT INTO {table} (key, value) VALUES (%s, %b) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
        )
        self.delete = f"DELETE FROM {table} WHERE key = %s"

    def cycle_for(self, worker: int) -> Cycle:
        conn = self.spec.raw_postgres()
        self.connections.append(conn)
        claims = itertools.cycle(_claim_keys(worker))

        def cycle() -> None:
            epoch_key, holder_key = next(claims)
            with conn.transaction():
                found = dict(conn.execute(self.lock_rows, [[epoch_key, holder_key]]).fetchall())
                if holder_key in found:
                    raise RuntimeError(f"{holder_key} is held")
                old = found.get(epoch_key)
                epoch = (0 if old is None else int.from_bytes(old, "big")) + 1
                epoch_bytes = epoch.to_bytes(8, "big")
                holder = _holder_bytes(self.engine_id, epoch)
                if conn.execute(self.insert_absent, [holder_key, holder]).rowcount != 1:
                    raise RuntimeError(f"{holder_key} was claimed concurrently")
                conn.execute(self.upsert, [epoch_key, epoch_bytes])
            with conn.transaction():
                found = dict(conn.execute(self.lock_rows, [[epoch_key, holder_key]]).fetchall())
                if found.get(epoch_key) != epoch_bytes or found.get(holder_key) != holder:
                    raise RuntimeError(f"{holder_key} moved on")
                conn.execute(self.delete, [holder_key])

        return cycle

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


class ToozContext:
    """tooz's file driver: one coordinator per worker, lock names like the claim ids."""

    def __init__(self, directory: str) -> None:
        self.url = f"file://{directory}"
        self.coordinators: list[Any] = []

    def cycle_for(self, worker: int) -> Cycle:
        from tooz import coordination

        coordinator = coordination.get_coordinator(self.url, f"member-{worker}".encode())
        coordinator.start()
        self.coordinators.append(coordinator)
        names = [f"w{worker:03d}-{n}".encode() for n in range(IDS_PER_WORKER)]
        locks = itertools.cycle([coordinator.get_lock(name) for name in names])

        def cycle() -> None:
            lock = next(locks)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"tooz lock {lock.name!r} is held")
            lock.release()

        return cycle

    def close(self) -> None:
        for coordinator in self.coordinators:
            coordinator.stop()


def open_context(variant: str, spec: StoreSpec, tooz_dir: str) -> Context:
    if variant == "library":
        return LibraryContext(spec)
    if variant == "raw" and spec.backend == "sqlite":
        return RawSqliteContext(spec, shared=False)
    if variant == "raw, one conn":
        return RawSqliteContext(spec, shared=True)
    if variant == "raw":
        return RawPostgresContext(spec)
    if variant == "tooz file":
        return ToozContext(tooz_dir)
    raise ValueError(f"unknown variant {variant!r}")


def run_threads(context: Context, first_worker: int, threads: int, seconds: float) -> int:
    """Run ``threads`` workers on ``context`` for ``seconds``; return the cycles completed."""
    cycles = [context.cycle_for(first_worker + n) for n in range(threads)]
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def body(index: int) -> None:
        try:
            start.wait()
            cycle, done = cycles[index], 0
            while time.perf_counter() < deadline[0]:
                cycle()
                done += 1
            counts[index] = done
        except BaseException as exc:
            errors.append(exc)

    workers = [
        threading.Thread(target=body, args=(n,), name=f"bench-worker-{n}", daemon=True)
        for n in range(threads)
    ]
    for worker in workers:
        worker.start()
    deadline[0] = time.perf_counter() + seconds
    start.wait()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return sum(counts)


def _process_main(
    variant: str,
    spec: StoreSpec,
    tooz_dir: str,
    first_worker: int,
    seconds: float,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    context = open_context(variant, spec, tooz_dir)
    try:
        cycle = context.cycle_for(first_worker)
        ready.put(os.getpid())
        go.wait()
        started = time.perf_counter()
        done = 0
        while time.perf_counter() - started < seconds:
            cycle()
            done += 1
        results.put((done, time.perf_counter() - started))
    except BaseException as exc:
        results.put((-1, repr(exc)))
        raise
    finally:
        context.close()


def run_processes(
    variant: str, spec: StoreSpec, tooz_dir: str, processes: int, seconds: float
) -> float:
    """Run one worker in each of ``processes`` spawned processes; return cycles per second."""
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_process_main,
            args=(variant, spec, tooz_dir, 100 + n, seconds, ready, go, results),
            name=f"bench-process-{n}",
        )
        for n in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        outcomes: list[tuple[int, Any]] = [results.get(timeout=120 + seconds) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    failed = [o for o in outcomes if o[0] < 0]
    if failed:
        raise RuntimeError(f"a {variant} worker process failed: {failed[0][1]}")
    total = sum(done for done, _ in outcomes)
    slowest = max(float(elapsed) for _, elapsed in outcomes)
    return total / slowest


def measure(
    variant: str, spec: StoreSpec, tooz_dir: str, processes: int, threads: int, seconds: float
) -> float:
    """Cycles per second of one variant in one layout."""
    if processes > 1:
        return run_processes(variant, spec, tooz_dir, processes, seconds)
    context = open_context(variant, spec, tooz_dir)
    try:
        started = time.perf_counter()
        done = run_threads(context, 0, threads, seconds)
        return done / (time.perf_counter() - started)
    finally:
        context.close()


def variants_for(backend: str, threads: int) -> list[str]:
    if backend == "postgres":
        return ["library", "raw"]
    if threads > 1:
        return ["library", "raw", "raw, one conn", "tooz file"]
    return ["library", "raw", "tooz file"]


def bench_backend(site: Site, backend: str, repeats: int, seconds: float) -> list[str]:
    columns = variants_for(backend, 16)
    rows = []
    verdicts = []
    for layout, processes, threads in LAYOUTS:
        spec = site.new_store(backend, name="cycles")
        spec.open().close()  # creates the table
        tooz_dir = str(site.tmp / f"tooz-{spec.table}")
        os.makedirs(tooz_dir, exist_ok=True)
        names = variants_for(backend, threads)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                rates[name].append(measure(name, spec, tooz_dir, processes, threads, seconds))
        best = {name: sorted(values)[len(values) // 2] for name, values in rates.items()}
        floor_name = max((n for n in best if n.startswith("raw")), key=best.__getitem__)
        overhead = best[floor_name] / best["library"]
        row = [layout, *(f"{best[n]:,.0f}" if n in best else "-" for n in columns)]
        row += [floor_name, ratio(best[floor_name], best["library"])]
        if "tooz file" in best:
            row.append(ratio(best["tooz file"], best["library"]))
        rows.append(row)
        if backend == "sqlite":
            verdicts.append(
                f"target sqlite {layout}: floor / library = {overhead:.2f}x "
                f"(<= {FLOOR_TARGET}x: {'MET' if overhead <= FLOOR_TARGET else 'MISSED'})"
            )
    headers = ["layout", *columns, "floor", "floor / library"]
    if "tooz file" in columns:
        headers.append("tooz / library")
    print_table(
        f"{backend}: acquire + release cycles per second (median of {repeats}, {seconds:g} s each)",
        headers,
        rows,
    )
    return verdicts


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="duration of each run")


def main() -> None:
    args = parse_args(__doc__, configure)
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (0.4 if args.quick else 1.5)
    print(f"acquire + release benchmark; {machine_note()}")
    backends = selected_backends(args)
    verdicts: list[str] = []
    with bench_site(backends) as site:
        for backend in backends:
            verdicts += bench_backend(site, backend, repeats, seconds)
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
