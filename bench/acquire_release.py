"""Acquire + release cycles per second: the library, a raw floor writing the same rows, Redis locks.

One cycle takes a claim (or lock) on an id only this worker uses and gives it back. Workers run
for a fixed time in three layouts: 1 thread, 16 threads sharing one store (or client) per
process, and 4 processes with one each. Every variant of a layout runs against the same table
and is measured in the same run, round by round, so drift hits them all alike.

Variants:

- ``claim()``: the facade. ``Ownership.open(url, options=OwnershipOptions(claim_ttl=30s,
  claim_renew_interval=5s))`` with its other defaults, then ``with own.claim(id): pass`` per
  cycle. ``claim()`` raises when the claim is unavailable, and its exit raises when the claim
  was lost; the handle's epoch is checked too. What else runs: ``background="thread"``
  maintenance, whose first tick comes one renew interval (5 s) after opening, so none runs
  inside a run shorter than that; the crash probe every 50 ms (it reads the engine records
  and probes the other engines' session locks: with 4 processes, three others); on PostgreSQL
  the claim clock is the database server's (``time_source="store"``). Opening and closing are
  not timed.
- ``registry``: a bare ``ClaimRegistry`` over ``SqliteStorage`` / ``PostgresStorage`` (same TTL
  and renew interval), ``registry.acquire(id)`` + ``registry.release(id)``, both statuses
  checked.
- ``raw``: hand-written transactions writing exactly the rows the library writes, with the
  library's own key functions (``weft_sync.keys``) and encoders (``weft_sync.codec``): the epoch
  key ``wf-owner-epoch:<id>`` holds a 16-byte token (8-byte big-endian epoch + 8 random mint
  bytes, ``mint_token``), the holder ``wf-owner-holder:<id>`` a MessagePack holder record
  (``encode_holder``: engine id, epoch, ``expires_at`` = now + TTL, ``claimed_at``), the
  by-engine entry ``wf-owner-by-engine:<engine>:<id>`` the 8-byte epoch (``encode_epoch``).
  SQLite, one connection per worker, WAL and ``synchronous=FULL`` like the library's: acquire
  is ``BEGIN IMMEDIATE``, SELECT holder (absent), SELECT epoch, REPLACE epoch + 1, REPLACE
  holder, REPLACE by-engine entry, COMMIT; release is ``BEGIN IMMEDIATE``, SELECT epoch and
  SELECT holder (both ours), DELETE holder, DELETE entry, COMMIT. ``raw, one conn`` (threads
  only): the same on one connection behind a ``threading.Lock``. PostgreSQL, one autocommit
  connection per worker, one transaction each: acquire is BEGIN, ``SELECT … FOR UPDATE`` of the
  three keys, one ``INSERT … SELECT unnest(…) ON CONFLICT DO UPDATE … WHERE key <> holder``
  writing the three rows (a holder that appeared concurrently is not overwritten and fails the
  cycle), COMMIT; release is BEGIN, ``SELECT … FOR UPDATE`` of the three keys (epoch and holder
  ours), one DELETE of holder and entry, COMMIT. The floor is the faster raw variant of each
  layout.
- ``redis-py`` and ``python-redis-lock`` (peers): ``redis.Redis(...).lock(name, timeout=30)``
  and ``redis_lock.Lock(conn, name, expire=30)``, ``acquire(blocking=False)`` + ``release()``
  (redis-py: SET NX PX, then a Lua compare-and-delete; python-redis-lock: GET, SET NX EX, then a
  Lua delete that also pushes its signal list). One ``redis.Redis`` client per process, shared
  by its threads: its connection pool gives each thread a connection of its own. The server is
  Debian's ``redis-server``, started here on a Unix socket with ``appendonly yes``,
  ``appendfsync always`` and ``save ''`` (every write is fsynced before it is acknowledged).
  Skipped, with the reason printed, when the server or the packages are missing, unless
  ``--require-redis`` is given.
- ``tooz file`` (peer, SQLite table only): tooz's file driver, ``get_lock(name)`` then
  ``acquire(blocking=False)`` + ``release()``; fcntl locks, nothing durable and no fencing
  token. Skipped when tooz is not installed.

Each layout keeps one store open on its table for its whole length, as a long-running engine
would: on SQLite the ``-wal`` and ``-shm`` then stay in place while the variants open and close
theirs, and the layout starts once the directory has been quiet for
``DIR_STAMP_MARGIN_NS`` (3 s), so that the library's pre-commit identity check rests on the
directory's stamp as it does in a settled host (see ``weft_sync.storage.sqlite.identity``).

Durability: SQLite commits with WAL and ``synchronous=FULL`` (the library's defaults);
PostgreSQL runs with ``fsync=on``, ``synchronous_commit=on`` and ``full_page_writes=on`` (the
throwaway cluster is restarted with them; a server from ``WEFT_SYNC_TEST_POSTGRES_DSN`` runs as
configured, and the header prints what it runs with); Redis fsyncs every write.

Targets, on each backend: acquire + release through ``claim()`` within 1.5x of the floor at 1
thread and within 1.2x at 16 threads and at 4 processes; ``claim()`` faster than both Redis
locks at 1 and at 16 threads (Redis is measured at 4 processes too, without a target).

    python bench/acquire_release.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--seconds S] [--require-redis]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    RENEW_MS,
    TTL_MS,
    Site,
    StoreSpec,
    bench_site,
    machine_note,
    new_registry,
    parse_args,
    postgres_settings,
    print_table,
    ratio,
    selected_backends,
)
from bench.redis_server import RedisServer, redis_missing, start_redis
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.clock import system_clock
from weft_sync.codec import HolderRecord, decode_epoch, encode_epoch, encode_holder, mint_token
from weft_sync.storage.sqlite.identity import DIR_STAMP_MARGIN_NS

IDS_PER_WORKER = 8
LAYOUTS = (("1 thread", 1, 1), ("16 threads", 1, 16), ("4 processes", 4, 1))
TARGETS = {"1 thread": 1.5, "16 threads": 1.2, "4 processes": 1.2}
PEER_LAYOUTS = ("1 thread", "16 threads")

CLAIM = "claim()"
REGISTRY = "registry"
RAW = "raw"
RAW_SHARED = "raw, one conn"
REDIS_PY = "redis-py"
REDIS_LOCK = "python-redis-lock"
TOOZ = "tooz file"
REDIS_VARIANTS = (REDIS_PY, REDIS_LOCK)
FLOORS = (RAW, RAW_SHARED)

Cycle = Callable[[], None]


class Context(Protocol):
    def cycle_for(self, worker: int) -> Cycle: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Target:
    """What the variants of one layout run against; picklable, for the worker processes."""

    spec: StoreSpec
    tooz_dir: str
    redis_socket: str | None


def _ids(worker: int) -> list[str]:
    return [f"w{worker:03d}-{n}" for n in range(IDS_PER_WORKER)]


@dataclass(frozen=True)
class ClaimRows:
    """The keys one acquire and release of ``workflow_id`` by ``engine_id`` write."""

    workflow_id: str
    epoch_key: str
    holder_key: str
    entry_key: str

    @classmethod
    def of(cls, workflow_id: str, engine_id: str) -> ClaimRows:
        return cls(
            workflow_id,
            keys.workflow_owner_epoch(workflow_id),
            keys.workflow_owner_holder(workflow_id),
            keys.workflow_owner_by_engine(engine_id, workflow_id),
        )


def _next_epoch(rows: ClaimRows, stored: bytes | None) -> int:
    """The epoch an acquire mints over the stored epoch value ``stored``."""
    if stored is None:
        return 1
    epoch = decode_epoch(stored)
    if epoch is None:
        raise RuntimeError(f"{rows.epoch_key} holds a corrupt epoch")
    return epoch + 1


def _holder_bytes(engine_id: str, epoch: int) -> bytes:
    now = system_clock()
    return encode_holder(HolderRecord(engine_id, epoch, now + TTL_MS, now))


# -- the library ----------------------------------------------------------------------------


class ClaimContext:
    """One ``Ownership`` per process, shared by its threads; ``with own.claim(id)`` per cycle."""

    def __init__(self, spec: StoreSpec) -> None:
        options = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
        self.ownership = Ownership.open(spec.url, options=options)

    def cycle_for(self, worker: int) -> Cycle:
        ids = itertools.cycle(_ids(worker))
        ownership = self.ownership

        def cycle() -> None:
            wid = next(ids)
            with ownership.claim(wid) as handle:
                if handle.epoch < 1:
                    raise RuntimeError(f"claim of {wid} gave {handle}")
            if handle.lost.is_set():
                raise RuntimeError(f"claim of {wid} was lost")

        return cycle

    def close(self) -> None:
        self.ownership.close()


class RegistryContext:
    """One store and one registry per process, shared by its threads."""

    def __init__(self, spec: StoreSpec) -> None:
        self.storage = spec.open()
        self.registry = new_registry(self.storage, engine_id=f"engine-{os.getpid()}")

    def cycle_for(self, worker: int) -> Cycle:
        ids = itertools.cycle(_ids(worker))
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


# -- the raw floor --------------------------------------------------------------------------


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
        claims = itertools.cycle([ClaimRows.of(wid, self.engine_id) for wid in _ids(worker)])
        engine_id, lock = self.engine_id, self.lock
        select, put, delete = self.select, self.put, self.delete

        def cycle() -> None:
            rows = next(claims)
            with lock:
                conn.execute("BEGIN IMMEDIATE")
                if conn.execute(select, (rows.holder_key,)).fetchone() is not None:
                    conn.execute("ROLLBACK")
                    raise RuntimeError(f"{rows.holder_key} is held")
                stored = conn.execute(select, (rows.epoch_key,)).fetchone()
                epoch = _next_epoch(rows, None if stored is None else stored[0])
                token = mint_token(epoch)
                holder = _holder_bytes(engine_id, epoch)
                conn.execute(put, (rows.epoch_key, token))
                conn.execute(put, (rows.holder_key, holder))
                conn.execute(put, (rows.entry_key, encode_epoch(epoch)))
                conn.execute("COMMIT")
            with lock:
                conn.execute("BEGIN IMMEDIATE")
                mine = conn.execute(select, (rows.epoch_key,)).fetchone() == (token,)
                if not mine or conn.execute(select, (rows.holder_key,)).fetchone() != (holder,):
                    conn.execute("ROLLBACK")
                    raise RuntimeError(f"{rows.holder_key} moved on")
                conn.execute(delete, (rows.holder_key,))
                conn.execute(delete, (rows.entry_key,))
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
        # Writes epoch, holder and entry; a holder row that exists is left alone (not returned).
        self.write = (
            f"INSERT INTO {table} AS t (key, value) "
            "SELECT k, v FROM unnest(%s::text[], %s::bytea[]) AS u(k, v) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value WHERE t.key <> %s "
            "RETURNING key"
        )
        self.delete = f"DELETE FROM {table} WHERE key = ANY(%s)"

    def cycle_for(self, worker: int) -> Cycle:
        conn = self.spec.raw_postgres()
        self.connections.append(conn)
        claims = itertools.cycle([ClaimRows.of(wid, self.engine_id) for wid in _ids(worker)])
        engine_id, lock_rows, write, delete = (
            self.engine_id,
            self.lock_rows,
            self.write,
            self.delete,
        )

        def cycle() -> None:
            rows = next(claims)
            every = [rows.entry_key, rows.epoch_key, rows.holder_key]
            with conn.transaction():
                found = dict(conn.execute(lock_rows, [every]).fetchall())
                if rows.holder_key in found:
                    raise RuntimeError(f"{rows.holder_key} is held")
                epoch = _next_epoch(rows, found.get(rows.epoch_key))
                token = mint_token(epoch)
                holder = _holder_bytes(engine_id, epoch)
                values = [encode_epoch(epoch), token, holder]
                written = conn.execute(write, [every, values, rows.holder_key]).fetchall()
                if len(written) != 3:
                    raise RuntimeError(f"{rows.holder_key} was claimed concurrently")
            with conn.transaction():
                found = dict(conn.execute(lock_rows, [every]).fetchall())
                if found.get(rows.epoch_key) != token or found.get(rows.holder_key) != holder:
                    raise RuntimeError(f"{rows.holder_key} moved on")
                if conn.execute(delete, [[rows.entry_key, rows.holder_key]]).rowcount != 2:
                    raise RuntimeError(f"{rows.entry_key} was missing")

        return cycle

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


# -- peers ----------------------------------------------------------------------------------


class RedisContext:
    """One ``redis.Redis`` client per process, shared by its threads (a pool connection each)."""

    def __init__(self, socket: str, *, library: str) -> None:
        import redis

        self.client = redis.Redis(unix_socket_path=socket)
        self.library = library

    def _lock(self, name: str) -> Any:
        ttl_s = TTL_MS // 1000
        if self.library == REDIS_PY:
            return self.client.lock(f"rp:{name}", timeout=ttl_s)
        import redis_lock

        return redis_lock.Lock(self.client, f"rl:{name}", expire=ttl_s)

    def cycle_for(self, worker: int) -> Cycle:
        locks = itertools.cycle([self._lock(name) for name in _ids(worker)])

        def cycle() -> None:
            lock = next(locks)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{self.library} lock {lock!r} is held")
            lock.release()

        return cycle

    def close(self) -> None:
        self.client.close()


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
        names = [name.encode() for name in _ids(worker)]
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


def open_context(variant: str, target: Target) -> Context:
    spec = target.spec
    if variant == CLAIM:
        return ClaimContext(spec)
    if variant == REGISTRY:
        return RegistryContext(spec)
    if variant == RAW and spec.backend == "sqlite":
        return RawSqliteContext(spec, shared=False)
    if variant == RAW_SHARED:
        return RawSqliteContext(spec, shared=True)
    if variant == RAW:
        return RawPostgresContext(spec)
    if variant in REDIS_VARIANTS:
        if target.redis_socket is None:
            raise RuntimeError("no Redis server was started for this run")
        return RedisContext(target.redis_socket, library=variant)
    if variant == TOOZ:
        return ToozContext(target.tooz_dir)
    raise ValueError(f"unknown variant {variant!r}")


# -- running --------------------------------------------------------------------------------


def run_threads(context: Context, first_worker: int, threads: int, seconds: float) -> float:
    """Run ``threads`` workers on ``context`` for ``seconds``; return cycles per second.

    The workers' setup (``cycle_for``) happens before the clock starts.
    """
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
    began = time.perf_counter()
    deadline[0] = began + seconds
    start.wait()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def _process_main(
    variant: str,
    target: Target,
    first_worker: int,
    seconds: float,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    context = open_context(variant, target)
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


def run_processes(variant: str, target: Target, processes: int, seconds: float) -> float:
    """Run one worker in each of ``processes`` spawned processes; return cycles per second."""
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_process_main,
            args=(variant, target, 100 + n, seconds, ready, go, results),
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


def measure(variant: str, target: Target, processes: int, threads: int, seconds: float) -> float:
    """Cycles per second of one variant in one layout."""
    if processes > 1:
        return run_processes(variant, target, processes, seconds)
    context = open_context(variant, target)
    try:
        return run_threads(context, 0, threads, seconds)
    finally:
        context.close()


# -- reporting ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peers:
    """Which optional contenders run, and why the others do not."""

    redis: RedisServer | None
    redis_skipped: str | None
    tooz_skipped: str | None


def variants_for(backend: str, threads: int, peers: Peers) -> list[str]:
    names = [CLAIM, REGISTRY, RAW]
    if backend == "sqlite" and threads > 1:
        names.append(RAW_SHARED)
    if peers.redis is not None:
        names += REDIS_VARIANTS
    if backend == "sqlite" and peers.tooz_skipped is None:
        names.append(TOOZ)
    return names


def _verdict(label: str, value: float, bound: float, *, below: bool = False) -> str:
    met = value < bound if below else value <= bound
    sign = "<" if below else "<="
    return f"{label} = {value:.2f}x ({sign} {bound:g}x: {'MET' if met else 'MISSED'})"


def bench_backend(
    site: Site, backend: str, peers: Peers, repeats: int, seconds: float
) -> list[str]:
    columns = variants_for(backend, 16, peers)
    rate_rows: list[list[str]] = []
    ratio_rows: list[list[str]] = []
    verdicts: list[str] = []
    socket = None if peers.redis is None else peers.redis.socket
    for layout, processes, threads in LAYOUTS:
        spec = site.new_store(backend, name="cycles")
        # A long-running engine on the store, as a host has: it creates the table, and on
        # SQLite keeps the -wal and -shm in place, so that the store's directory settles and
        # the writers' identity check may rest on its stamp (see
        # weft_sync.storage.sqlite.identity); the layout waits for that once.
        resident = spec.open()
        if backend == "sqlite":
            time.sleep(DIR_STAMP_MARGIN_NS / 1e9 + 0.2)
        tooz_dir = str(site.tmp / f"tooz-{spec.table}")
        os.makedirs(tooz_dir, exist_ok=True)
        target = Target(spec, tooz_dir, socket)
        names = variants_for(backend, threads, peers)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                rates[name].append(measure(name, target, processes, threads, seconds))
        resident.close()
        best = {name: sorted(values)[len(values) // 2] for name, values in rates.items()}
        floor_name = max((n for n in best if n in FLOORS), key=best.__getitem__)
        floor, claim = best[floor_name], best[CLAIM]
        rate_rows.append([layout, *(f"{best[n]:,.0f}" if n in best else "-" for n in columns)])
        row = [layout, floor_name, ratio(floor, claim), ratio(floor, best[REGISTRY])]
        row += [
            ratio(best[n], claim) if n in best else "-"
            for n in columns
            if n in (*REDIS_VARIANTS, TOOZ)
        ]
        ratio_rows.append(row)
        prefix = f"target {backend} {layout}:"
        verdicts.append(f"{prefix} {_verdict('floor / claim()', floor / claim, TARGETS[layout])}")
        if layout not in PEER_LAYOUTS:
            continue
        for peer in REDIS_VARIANTS:
            label = f"claim() faster than {peer}: {peer} / claim()"
            if peer in best:
                verdicts.append(f"{prefix} {_verdict(label, best[peer] / claim, 1.0, below=True)}")
            else:
                verdicts.append(
                    f"{prefix} claim() faster than {peer}: SKIPPED ({peers.redis_skipped})"
                )
    print_table(
        f"{backend}: acquire + release cycles per second (median of {repeats}, {seconds:g} s each)",
        ["layout", *columns],
        rate_rows,
    )
    peer_columns = [n for n in columns if n in (*REDIS_VARIANTS, TOOZ)]
    print_table(
        f"{backend}: ratios (below 1.0: the library is faster)",
        ["layout", "floor", "floor / claim()", "floor / registry"]
        + [f"{'tooz' if n == TOOZ else n} / claim()" for n in peer_columns],
        ratio_rows,
    )
    if peers.redis_skipped is not None:
        print(f"{', '.join(REDIS_VARIANTS)}: skipped ({peers.redis_skipped})")
    if backend == "sqlite" and peers.tooz_skipped is not None:
        print(f"{TOOZ}: skipped ({peers.tooz_skipped})")
    return verdicts


def durability_notes(site: Site, backends: Sequence[str], peers: Peers) -> list[str]:
    notes = []
    if "sqlite" in backends:
        notes.append("sqlite: WAL, synchronous=FULL (the library's defaults; raw uses the same)")
    if "postgres" in backends and site.pg_url is not None:
        where = (
            "server from WEFT_SYNC_TEST_POSTGRES_DSN"
            if os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
            else "throwaway cluster, restarted durable"
        )
        notes.append(f"postgres: {postgres_settings(site.pg_url)} ({where})")
    if peers.redis is not None:
        notes.append(
            f"redis: {peers.redis.note}; one redis.Redis client per process, a pool "
            "connection per thread"
        )
    else:
        notes.append(f"redis: skipped ({peers.redis_skipped})")
    return notes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="duration of each run")
    parser.add_argument(
        "--require-redis",
        action="store_true",
        help="fail instead of skipping the Redis locks when Redis cannot run here",
    )


def main() -> None:
    args = parse_args(__doc__, configure)
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (0.4 if args.quick else 1.5)
    backends = selected_backends(args)
    redis_skipped = redis_missing()
    if redis_skipped is not None and args.require_redis:
        sys.exit(f"--require-redis: Redis cannot run here: {redis_skipped}")
    tooz_skipped = None if importlib.util.find_spec("tooz") else "tooz is not installed"
    print(f"acquire + release benchmark; {machine_note()}")
    verdicts: list[str] = []
    with contextlib.ExitStack() as stack:
        site = stack.enter_context(bench_site(backends, durable_postgres=True))
        redis: RedisServer | None = None
        if redis_skipped is None:
            try:
                redis = stack.enter_context(start_redis(site.tmp / "redis"))
            except Exception as exc:
                if args.require_redis:
                    raise
                redis_skipped = f"redis-server did not start: {exc}"
        peers = Peers(redis, redis_skipped, tooz_skipped)
        for note in durability_notes(site, backends, peers):
            print(f"durability: {note}")
        print(
            "claim(): Ownership.open(url, claim_ttl=30s, claim_renew_interval=5s), "
            'background="thread": crash probe every 50 ms, first maintenance tick after 5 s'
        )
        for backend in backends:
            verdicts += bench_backend(site, backend, peers, repeats, seconds)
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
