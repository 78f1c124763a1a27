"""Faults at the storage edges, measured on real stores with real attacks from outside.

- ``row-lock``: 50 claims (TTL 3 s, renew 1 s); a foreign PostgreSQL session holds ONE holder row
  with ``SELECT … FOR UPDATE`` for 8 s while an observer engine reclaims: claims the victim keeps.
- ``close``: another session holds the claims table locked (PostgreSQL ``LOCK TABLE … ACCESS
  EXCLUSIVE``; SQLite a foreign ``BEGIN IMMEDIATE``): how long ``save_checkpoint`` takes to fail
  and ``Ownership.close(timeout=2)`` takes to return; of the claims still held at the close, how
  many it released and how many it left to expire in the store.
- ``kill-storm``: ``pg_terminate_backend`` of the engine's sessions every second for 15 s: renewal
  passes that failed, claims lost, and the time from the storm's end until every claim was
  renewed again, against the renew interval.
- ``sqlite-file``: the database (with -wal and -shm) deleted, or replaced by a copy, under a
  running engine that keeps writing checkpoints: writes it accepted after the fault; and what the
  identity checks cost next to one durable ``put``.

    python bench/edges.py [--quick] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    StoreSpec,
    bench_site,
    interleave,
    machine_note,
    ms,
    parse_args,
    print_table,
    ratio,
    selected_backends,
    us,
)
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow
from weft_sync.codec import decode_holder
from weft_sync.errors import EngineDeposedError, StorageError
from weft_sync.keys import workflow_owner_holder
from weft_sync.storage import Put

FAST = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
CLAIMS = 50


def _ids(n: int = CLAIMS) -> list[str]:
    return [f"wf-{i:03d}" for i in range(n)]


def _quiet(_warning: Warning) -> None:
    """Warnings are counted from the holders, not printed."""


def _holders(spec: StoreSpec, ids: list[str]) -> list[tuple[str, int] | None]:
    keys = [workflow_owner_holder(wid) for wid in ids]
    if spec.backend == "postgres":
        with spec.raw_postgres() as conn:
            rows = conn.execute(
                f'SELECT key, value FROM "{spec.table}" WHERE key = ANY(%s)', [keys]
            ).fetchall()
    else:
        with contextlib.closing(spec.raw_sqlite()) as conn:
            marks = ",".join("?" * len(keys))
            rows = conn.execute(
                f'SELECT key, value FROM "{spec.table}" WHERE key IN ({marks})', keys
            ).fetchall()
    found = {str(k): decode_holder(bytes(v)) for k, v in rows}
    out: list[tuple[str, int] | None] = []
    for key in keys:
        record = found.get(key)
        out.append(None if record is None else (record.engine_id, record.expires_at))
    return out


@contextlib.contextmanager
def _ownership(url: str, **kwargs: object) -> Iterator[Ownership]:
    ownership = Ownership.open(url, options=FAST, warn=_quiet, **kwargs)  # type: ignore[arg-type]
    try:
        yield ownership
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ownership.close(timeout=5)


# -- row lock -------------------------------------------------------------------------------


def row_lock_attack(spec: StoreSpec, hold_s: float) -> list[object]:
    ids = _ids()
    measured = threading.Event()

    def keep(_ctx: ReclaimedWorkflow) -> None:
        measured.wait()  # the observer's handler drives what it took until the holders are read

    # The victim's drives are entered before the engines open, so they end after the closes
    # released the claims: none is left unfinished.
    with (
        contextlib.ExitStack() as drives,
        _ownership(spec.url) as victim,
        _ownership(spec.url, handlers={"report": keep}) as obs,
    ):
        try:
            for wid in ids:
                victim.workflows.start(wid, "report")
                drives.enter_context(victim.workflows.drive(wid))
            with spec.raw_postgres() as foreign, foreign.transaction():
                foreign.execute(
                    f'SELECT key FROM "{spec.table}" WHERE key = %s FOR UPDATE',
                    [workflow_owner_holder(ids[0])],
                )
                time.sleep(hold_s)
            time.sleep(FAST.claim_ttl_ms / 1000)  # one more TTL for the observer to act
            holders = _holders(spec, ids)
        finally:
            measured.set()
        kept = sum(1 for h in holders if h is not None and h[0] == victim.engine_id)
        taken = sum(1 for h in holders if h is not None and h[0] == obs.engine_id)
        failures = victim.metrics.snapshot().renewal_failures
    return [f"{hold_s:.0f} s", f"{kept}/{CLAIMS}", taken, failures, "≥ 49/50"]


# -- close under a table lock ---------------------------------------------------------------


@contextlib.contextmanager
def _table_locked(spec: StoreSpec) -> Iterator[None]:
    if spec.backend == "postgres":
        with spec.raw_postgres() as conn, conn.transaction():
            conn.execute(f'LOCK TABLE "{spec.table}" IN ACCESS EXCLUSIVE MODE')
            yield
        return
    conn = spec.raw_sqlite()
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def close_under_lock(spec: StoreSpec, options: OwnershipOptions) -> list[object]:
    victim = Ownership.open(spec.url, options=options, warn=_quiet)
    drives = contextlib.ExitStack()  # closed after the victim: its drives end with no claim left
    ids = _ids(10)
    try:
        for wid in ids:
            victim.workflows.start(wid, "report")
            drives.enter_context(victim.workflows.drive(wid))
        with _table_locked(spec):
            started = time.monotonic()
            try:
                victim.workflows.save_checkpoint("wf-000", b"blocked")
                outcome = "accepted"
            except StorageError:
                outcome = "StorageError"
            failed_after = time.monotonic() - started
            held = sorted(victim.registry.list_held_workflow_ids())
            started = time.monotonic()
            victim.close(timeout=2)
            closed_after = time.monotonic() - started
    finally:
        victim.close()
        drives.close()
    left = sum(1 for h in _holders(spec, held) if h is not None and h[0] == victim.engine_id)
    label = f"{spec.backend}, renew {options.claim_renew_interval_ms} ms"
    return [
        label,
        outcome,
        f"{failed_after:.2f} s",
        f"{len(held) - left} / {left}",
        f"{closed_after:.2f} s",
        "≤ 3.00 s",
    ]


# -- kill storm ---------------------------------------------------------------------------


def kill_storm(spec: StoreSpec, storm_s: float) -> list[object]:
    name = f"weft-storm-{uuid.uuid4().hex[:8]}"
    url = f"{spec.url}&application_name={name}"
    ids = _ids()
    lost: list[Warning] = []
    victim = Ownership.open(url, options=FAST, warn=lost.append)
    drives = contextlib.ExitStack()  # closed after the victim: its drives end with no claim left
    try:
        for wid in ids:
            victim.workflows.start(wid, "report")
            drives.enter_context(victim.workflows.drive(wid))
        killed = 0
        end = time.monotonic() + storm_s
        with spec.raw_postgres() as admin:
            while time.monotonic() < end:
                killed += len(
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = %s",
                        [name],
                    ).fetchall()
                )
                time.sleep(1.0)
        storm_end_ms = time.time() * 1000
        recovered_ms = float("nan")
        deadline = time.monotonic() + 10 * FAST.claim_renew_interval_ms / 1000
        while time.monotonic() < deadline:
            holders = _holders(spec, ids)
            mine = [h[1] for h in holders if h is not None and h[0] == victim.engine_id]
            # A holder renewed after the storm expires later than the storm's end plus a TTL.
            if len(mine) == len(ids) and min(mine) - FAST.claim_ttl_ms >= storm_end_ms:
                recovered_ms = time.time() * 1000 - storm_end_ms
                break
            time.sleep(0.02)
        failures = victim.metrics.snapshot().renewal_failures
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            victim.close(timeout=5)
        drives.close()
    return [
        f"{storm_s:.0f} s",
        killed,
        failures,
        len(lost),
        f"{recovered_ms:.0f} ms",
        f"≤ {FAST.claim_renew_interval_ms} ms",
    ]


# -- SQLite file deleted or replaced -------------------------------------------------------


def sqlite_file_fault(spec: StoreSpec, fault: str) -> list[object]:
    assert spec.path is not None
    ids = _ids()
    victim = Ownership.open(spec.url, options=FAST, warn=_quiet)
    accepted_after = refused_after = 0
    stop = threading.Event()
    faulted = threading.Event()

    def writer() -> None:
        nonlocal accepted_after, refused_after
        n = 0
        while not stop.is_set():
            after = faulted.is_set()
            try:
                victim.workflows.save_checkpoint(ids[n % len(ids)], b"step-%d" % n)
            except (StorageError, EngineDeposedError):  # deposed: the fault lost the claims
                if after:
                    refused_after += 1
                stop.wait(0.005)
            else:
                if after:
                    accepted_after += 1
            n += 1

    drives = contextlib.ExitStack()  # closed after the victim: its drives end with no claim left
    try:
        for wid in ids:
            victim.workflows.start(wid, "report")
            drives.enter_context(victim.workflows.drive(wid))
        thread = threading.Thread(target=writer, name="bench-writer")
        thread.start()
        time.sleep(0.5)
        if fault == "deleted":
            for suffix in ("", "-wal", "-shm"):
                os.unlink(spec.path + suffix)
        else:
            copy = spec.path + ".copy"
            with sqlite3.connect(spec.path) as src, sqlite3.connect(copy) as dst:
                src.backup(dst)
            os.replace(copy, spec.path)
        faulted.set()
        time.sleep(2 * FAST.claim_renew_interval_ms / 1000)  # two passes
        stop.set()
        thread.join(30)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            victim.close(timeout=5)
        drives.close()
    return [fault, refused_after, accepted_after, "0"]


def identity_cost(spec: StoreSpec) -> list[object]:
    from weft_sync.storage import SqliteStorage

    assert spec.path is not None
    with SqliteStorage(spec.path, table=spec.table) as store:
        check = interleave(
            {
                "files": store._identity.check_files,
                "verify": store.verify_identity,
                "put": lambda: store.put("k", b"v"),
            },
            200,
        )
    files, verify, put = (check[k].median_wall for k in ("files", "verify", "put"))
    return [us(files), us(verify), us(put), ratio(files, put)]


def isolation_cost(spec: StoreSpec, rows: int) -> list[object]:
    from weft_sync.storage.postgres.store import PostgresStorage

    store = spec.open()
    assert isinstance(store, PostgresStorage)
    keys = [f"wf-owner-holder:bench-{i:05d}" for i in range(rows)]
    current = dict.fromkeys(keys, b"v-0")
    store.batch([Put(k, v) for k, v in current.items()])
    step = [0]

    def renew(method: str) -> None:
        step[0] += 1
        new = b"v-%d" % step[0]
        batch = [(k, current[k], new) for k in keys]
        results = getattr(store, method)(batch)
        assert all(r is True for r in results)
        current.update(dict.fromkeys(keys, new))

    try:
        samples = interleave(
            {
                "plain": lambda: renew("compare_and_set_many"),
                "isolated": lambda: renew("compare_and_set_many_isolated"),
            },
            10,
        )
    finally:
        store.close()
    plain, isolated = samples["plain"].median_wall, samples["isolated"].median_wall
    return [rows, ms(plain), ms(isolated), ratio(isolated, plain)]


def main() -> None:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--storm-seconds", type=float, default=None)
        parser.add_argument("--lock-seconds", type=float, default=8.0)

    args = parse_args(__doc__, configure)
    backends = selected_backends(args)
    storm_s = args.storm_seconds or (5.0 if args.quick else 15.0)
    print(machine_note())
    with bench_site(backends) as site:
        if "postgres" in backends:
            print_table(
                "row-lock attack (PostgreSQL): one holder row locked by a foreign session",
                ["lock held", "victim kept", "observer took", "renewal failures", "target"],
                [row_lock_attack(site.new_store("postgres"), args.lock_seconds)],
            )
        rows = []
        for backend in backends:
            rows.append(close_under_lock(site.new_store(backend), FAST))
            rows.append(close_under_lock(site.new_store(backend), OwnershipOptions()))
        print_table(
            "close(timeout=2) while another session holds the table locked",
            [
                "backend",
                "save_checkpoint",
                "failed after",
                "held at close: released / left to expire",
                "close took",
                "target",
            ],
            rows,
        )
        if "postgres" in backends:
            print_table(
                "batched renewal on PostgreSQL: waiting UPDATE vs isolated (SKIP LOCKED) statement",
                ["rows", "compare_and_set_many", "…_isolated", "isolated / plain"],
                [isolation_cost(site.new_store("postgres"), 2000)],
            )
            print_table(
                "kill storm (PostgreSQL): pg_terminate_backend of the engine's sessions every 1 s",
                ["storm", "killed", "renewal failures", "lost", "recovered after", "target"],
                [kill_storm(site.new_store("postgres"), storm_s)],
            )
        if "sqlite" in backends:
            print_table(
                "SQLite file fault under a running engine writing checkpoints",
                ["fault", "writes refused after", "accepted after", "target"],
                [sqlite_file_fault(site.new_store("sqlite"), f) for f in ("deleted", "replaced")],
            )
            print_table(
                "SQLite identity checks, median (files: before each commit; verify: each pass)",
                ["files check", "verify_identity", "one put (FULL)", "files / put"],
                [identity_cost(site.new_store("sqlite"))],
            )


if __name__ == "__main__":
    main()
