"""Shared benchmark helpers: arguments, timing, tables, stores on both backends, claim seeding.

Every benchmark measures the library and its raw floor (or peer) in the same run, interleaving
the repeats, and prints medians and the ratios between them. Ratios from one run are meaningful on
a noisy machine; absolute numbers from different runs are not comparable.

PostgreSQL comes from ``WEFT_SYNC_TEST_POSTGRES_DSN`` when set, otherwise from a throwaway cluster
started with ``tests/pgcluster.py`` (it runs with ``fsync=off`` and ``synchronous_commit=off``, so
PostgreSQL numbers exclude durable-commit costs). ``bench_site(..., durable_postgres=True)``
restarts that cluster with ``fsync=on``, ``synchronous_commit=on`` and ``full_page_writes=on``
instead; :func:`postgres_settings` reads back what a server runs with. SQLite stores use the
library defaults: WAL and ``synchronous=FULL``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from weft_sync import keys  # noqa: E402
from weft_sync.claims.engine_index import with_claim_entry  # noqa: E402
from weft_sync.claims.registry import ClaimRegistry  # noqa: E402
from weft_sync.claims.results import AcquirePreparation  # noqa: E402
from weft_sync.claims.transitions import build_acquire_transition  # noqa: E402
from weft_sync.clock import Clock, system_clock  # noqa: E402
from weft_sync.codec import WorkflowRecord, encode_workflow_record  # noqa: E402
from weft_sync.errors import WorkflowClaimUnavailableError  # noqa: E402
from weft_sync.storage import Operation, Put, Storage, open_storage  # noqa: E402

if TYPE_CHECKING:
    from tests.pgcluster import PostgresCluster
    from weft_sync import Ownership

BACKENDS = ("sqlite", "postgres")
ENGINE_ID = "bench-engine"
TTL_MS = 30_000
RENEW_MS = 5_000
SEED_CHUNK = 5_000


# -- arguments ------------------------------------------------------------------------------


def parse_args(
    doc: str | None, configure: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """Parse the options every benchmark shares (``--quick``, ``--repeats``, ``--backend``)."""
    text = doc or ""
    parser = argparse.ArgumentParser(
        description=text.splitlines()[0] if text else None,
        epilog="\n".join(text.splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repeats (about 30 s)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    parser.add_argument(
        "--backend", choices=(*BACKENDS, "both"), default="both", help="which store(s) to use"
    )
    if configure is not None:
        configure(parser)
    return parser.parse_args()


def selected_backends(args: argparse.Namespace) -> tuple[str, ...]:
    return BACKENDS if args.backend == "both" else (str(args.backend),)


# -- timing and tables ----------------------------------------------------------------------


@dataclass
class Samples:
    """Wall-clock and process CPU seconds of repeated calls of one variant."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, fn: Callable[[], object]) -> None:
        """Time one call of ``fn`` (after a full garbage collection, not timed)."""
        gc.collect()
        cpu = time.process_time()
        wall = time.perf_counter()
        fn()
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)

    @property
    def median_wall(self) -> float:
        return statistics.median(self.wall)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds one call of ``fn`` took (after a full garbage collection)."""
    samples = Samples()
    samples.add(fn)
    return samples.wall[0]


def interleave(variants: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, Samples]:
    """Time every variant ``repeats`` times, round-robin, so drift hits them all alike.

    Process CPU time is recorded too: on a shared machine it is the steadier of the two, but it
    counts every thread of this process and none of a server's (PostgreSQL) work.
    """
    samples = {name: Samples() for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].add(fn)
    return samples


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    """Format seconds as milliseconds with sensible precision."""
    value = seconds * 1000
    if value >= 100:
        return f"{value:,.0f} ms"
    if value >= 10:
        return f"{value:.1f} ms"
    return f"{value:.2f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def ratio(numerator: float, denominator: float) -> str:
    if denominator <= 0:
        return "n/a"
    value = numerator / denominator
    return f"{value:,.0f}x" if value >= 100 else f"{value:.2f}x"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print an aligned plain-text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts)

    print()
    print(title)
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def machine_note() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, "
        f"{os.cpu_count()} cpus, load average {load:.2f}"
    )


# -- stores ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSpec:
    """One fresh store: its library URL and what a raw driver needs to reach the same table."""

    backend: str
    url: str
    table: str
    path: str | None = None  # SQLite file
    dsn: str | None = None  # PostgreSQL URL without the library's ``table`` parameter

    def open(self) -> Storage:
        return open_storage(self.url)

    def raw_sqlite(self, synchronous: str = "FULL") -> sqlite3.Connection:
        """A plain ``sqlite3`` connection configured like the library's (WAL, same sync)."""
        assert self.path is not None
        conn = sqlite3.connect(
            self.path, isolation_level=None, timeout=60.0, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("PRAGMA busy_timeout = 60000")
        return conn

    def raw_postgres(self) -> Any:
        """A plain autocommit psycopg connection to the same server."""
        import psycopg

        assert self.dsn is not None
        return psycopg.connect(self.dsn, autocommit=True)

    def create_raw_table(self, table: str) -> None:
        """Create another table of the library's shape next to this one (for a raw floor)."""
        if self.backend == "sqlite":
            with contextlib.closing(self.raw_sqlite()) as conn:
                conn.execute(
                    f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)'
                )
        else:
            with self.raw_postgres() as conn:
                conn.execute(
                    f'CREATE TABLE IF NOT EXISTS "{table}" '
                    f'(key TEXT COLLATE "C" PRIMARY KEY, value BYTEA NOT NULL)'
                )


@dataclass
class Site:
    """Where a benchmark's stores live: a temporary directory and, when needed, a server."""

    tmp: Path
    pg_url: str | None

    def new_store(self, backend: str, name: str = "bench") -> StoreSpec:
        table = "b_" + uuid.uuid4().hex[:12]
        if backend == "sqlite":
            path = str(self.tmp / f"{name}-{table}.db")
            return StoreSpec(backend, f"sqlite:///{path}?table={table}", table, path=path)
        if self.pg_url is None:
            raise RuntimeError("no PostgreSQL server was started for this run")
        sep = "&" if "?" in self.pg_url else "?"
        return StoreSpec(backend, f"{self.pg_url}{sep}table={table}", table, dsn=self.pg_url)


DURABLE_POSTGRES_SETTINGS = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")
REPORTED_POSTGRES_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method")


@contextmanager
def bench_site(backends: Sequence[str], *, durable_postgres: bool = False) -> Iterator[Site]:
    """A temporary directory, plus a PostgreSQL server if ``postgres`` is among ``backends``.

    :param durable_postgres: run the throwaway cluster with durable commits
        (:data:`DURABLE_POSTGRES_SETTINGS`) rather than ``tests/pgcluster.py``'s fast settings.
        A server given by ``WEFT_SYNC_TEST_POSTGRES_DSN`` runs as it was configured; read its
        settings with :func:`postgres_settings`.
    """
    with tempfile.TemporaryDirectory(prefix="weft-bench-") as tmp:
        if "postgres" not in backends:
            yield Site(Path(tmp), None)
            return
        env = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
        if env:
            yield Site(Path(tmp), env)
            return
        from tests.pgcluster import start_cluster

        cluster = start_durable_cluster() if durable_postgres else start_cluster()
        try:
            yield Site(Path(tmp), cluster.url)
        finally:
            cluster.stop()


def start_durable_cluster() -> PostgresCluster:
    """A throwaway cluster (``tests/pgcluster.py``) restarted with durable commit settings.

    The server is started once as the test suite starts it, then stopped and started again on
    the same data directory with :data:`DURABLE_POSTGRES_SETTINGS` on its command line.
    """
    from tests.pgcluster import PostgresCluster, as_server_user, run_checked, start_cluster

    class DurablePostgresCluster(PostgresCluster):
        def start(self) -> None:
            settings = " ".join(f"-c {setting}" for setting in DURABLE_POSTGRES_SETTINGS)
            opts = f"-k {self.directory} -c listen_addresses='' {settings} -c max_connections=300"
            cmd = [self.pg_ctl, "-D", str(self.data_dir), "-o", opts]
            cmd += ["-l", str(self.directory / "server.log"), "-w", "-t", "60", "start"]
            run_checked(as_server_user(cmd))

    fast = start_cluster()
    cluster = DurablePostgresCluster(fast.directory, fast.pg_ctl)
    try:
        cluster.restart()
    except BaseException:
        fast.stop()
        raise
    return cluster


def postgres_settings(dsn: str, names: Sequence[str] = REPORTED_POSTGRES_SETTINGS) -> str:
    """``name=value`` of each of ``names`` as the server at ``dsn`` runs it, comma-separated."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        values = [
            f"{name}={conn.execute(f'SHOW {name}').fetchone()[0]}"  # type: ignore[index]
            for name in names
        ]
    return ", ".join(values)


# -- claims ---------------------------------------------------------------------------------


def new_registry(
    storage: Storage,
    *,
    engine_id: str = ENGINE_ID,
    clock: Clock = system_clock,
    ttl_ms: int = TTL_MS,
    renew_ms: int = RENEW_MS,
) -> ClaimRegistry:
    return ClaimRegistry(
        storage,
        engine_id=engine_id,
        clock=clock,
        claim_ttl_ms=ttl_ms,
        claim_renew_interval_ms=renew_ms,
    )


def hold_claims(
    registry: ClaimRegistry,
    storage: Storage,
    ids: Sequence[str],
    *,
    ttl_ms: int = TTL_MS,
    now: int | None = None,
) -> None:
    """Make ``registry`` hold a fresh claim (epoch 1) on every id of an empty store.

    Writes the exact epoch, holder and by-engine entry an acquire would write, in large plain
    batches, then tracks them with ``record_folded_acquire``: the same durable and local state
    as one ``acquire`` per id, much faster to set up.
    """
    at = registry_clock_now(now)
    for start in range(0, len(ids), SEED_CHUNK):
        chunk = ids[start : start + SEED_CHUNK]
        preparations = [
            AcquirePreparation(
                with_claim_entry(
                    build_acquire_transition(
                        workflow_id=wid,
                        engine_id=registry.engine_id,
                        now=at,
                        claim_ttl_ms=ttl_ms,
                        observed_epoch_bytes=None,
                    ),
                    wid,
                    registry.engine_id,
                    None,
                ),
                1,
                at,
            )
            for wid in chunk
        ]
        storage.batch([op for p in preparations for op in p.fragment.operations])
        for wid, preparation in zip(chunk, preparations, strict=True):
            registry.record_folded_acquire(wid, preparation)


def registry_clock_now(now: int | None) -> int:
    return system_clock() if now is None else now


def running_workflow_ops(workflow_id: str, now: int) -> list[Operation]:
    """The record and status-index entry of a running workflow, as a host's ledger writes them."""
    record = WorkflowRecord(workflow_id, "bench", "running", created_at=now, updated_at=now)
    return [
        Put(keys.workflow(workflow_id), encode_workflow_record(record)),
        Put(keys.workflow_status_index("running", workflow_id), b""),
    ]


def write_in_chunks(storage: Storage, operations: Sequence[Operation], chunk: int = 20_000) -> None:
    for start in range(0, len(operations), chunk):
        storage.batch(list(operations[start : start + chunk]))


def workflow_ids(count: int, prefix: str = "wf") -> list[str]:
    return [f"{prefix}-{n:06d}" for n in range(count)]


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/status``."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


# -- drives ---------------------------------------------------------------------------------


def enter_drive(ownership: Ownership, drives: contextlib.ExitStack, workflow_id: str) -> bool:
    """Enter a ``drive()`` block of a claim ``ownership`` holds into ``drives``; ``False``: later.

    What a handler hands on to the host's own thread is driven this way (a handler that returns
    without finishing leaves its claim to be released one renew interval later). A claim no
    longer held here is dropped (``True``); one its handler still drives, between the hand-off
    and the handler's return, is refused (``False``: enter it again later).
    """
    if ownership.registry.current_epoch(workflow_id) is None:
        return True
    try:
        drives.enter_context(ownership.workflows.drive(workflow_id))
    except WorkflowClaimUnavailableError:
        return False
    return True
