"""Reclaim pass over stranded claims: one ``run_once()`` of a fresh engine against raw floors.

A dead engine left N claims (10,000; ``--quick``: 2,000) on running workflows: expired holders
(epoch 1), workflow records with status ``running`` and their status-index entries. Measured in
the same run, each repeat on a freshly seeded store:

- ``run_once``: a fresh engine (``bootstrap_workflow_lease_ownership``, no renewals of its own)
  runs ``renewal_task.run_once()``; its reclaim sub-pass lists the candidates (holder scan,
  running-index scan, a 500-record authoritative window), prepares them in chunks of 200 on the
  16-thread pool (one ``get_many`` of holders and epochs and one ``conditional_batches`` of
  takeovers per chunk), then completes each candidate on the pool: re-read its workflow record,
  check the claim is still held, drive it;
- ``discovery only``: ``list_reclaim_candidates`` on the seeded store (read-only);
- ``raw, one txn``: by hand, in ONE transaction: scan the holders, decode each, check expiry,
  read epoch and workflow record, write the token of epoch + 1 (``mint_token``, as the library
  mints it) and a new holder (SQLite: per-key statements; PostgreSQL: three row-locking SELECTs
  and one upsert from ``unnest``);
- ``raw, txn per claim`` (SQLite): the same with one ``BEGIN IMMEDIATE`` transaction (and fsync)
  per claim, on one thread: what per-claim CAS costs without group commit.

    python bench/reclaim_pass.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack

from bench.common import (
    RENEW_MS,
    TTL_MS,
    Samples,
    Site,
    StoreSpec,
    bench_site,
    machine_note,
    ms,
    parse_args,
    print_table,
    ratio,
    running_workflow_ops,
    selected_backends,
    us,
    workflow_ids,
    write_in_chunks,
)
from weft_sync import keys
from weft_sync.claims.transitions import build_acquire_transition
from weft_sync.clock import system_clock
from weft_sync.codec import decode_epoch, mint_token
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.reclaim.scan import list_reclaim_candidates
from weft_sync.storage import Operation
from weft_sync.storage.base import prefix_upper_bound

DEAD_ENGINE = "dead-engine"
SURVIVOR = "survivor-engine"
HOLDER_PREFIX = keys.workflow_owner_holder("")


def seed_stranded(spec: StoreSpec, ids: list[str]) -> None:
    """Write a dead engine's expired claims and their running workflows into a fresh store."""
    long_ago = system_clock() - 10 * TTL_MS
    operations: list[Operation] = []
    for wid in ids:
        fragment = build_acquire_transition(
            workflow_id=wid,
            engine_id=DEAD_ENGINE,
            now=long_ago,
            claim_ttl_ms=TTL_MS,
            observed_epoch_bytes=None,
        )
        operations += fragment.operations
        operations += running_workflow_ops(wid, long_ago)
    with contextlib.closing(spec.open()) as storage:
        write_in_chunks(storage, operations)


def library_pass(spec: StoreSpec, expected: int) -> None:
    with contextlib.closing(spec.open()) as storage:
        ownership = bootstrap_workflow_lease_ownership(
            storage=storage,
            clock=system_clock,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            engine_id=SURVIVOR,
        )
        try:
            result = ownership.renewal_task.run_once()
        finally:
            ownership.renewal_task.close()
        reclaim = result.reclaim
        if reclaim is None or reclaim.reclaimed_count != expected:
            got = None if reclaim is None else reclaim.reclaimed_count
            raise SystemExit(f"run_once reclaimed {got} of {expected} claims")


def _new_holder(epoch: int, now: int) -> bytes:
    record = {"engine_id": SURVIVOR, "epoch": epoch, "expires_at": now + TTL_MS, "claimed_at": now}
    packed: bytes = msgpack.packb(record, use_bin_type=True)
    return packed


def _expired(holder: bytes, now: int) -> bool:
    return int(msgpack.unpackb(holder)["expires_at"]) + 2 * RENEW_MS < now


def _running(record: bytes | None) -> bool:
    return record is not None and msgpack.unpackb(record).get("status") == "running"


def raw_sqlite(spec: StoreSpec, expected: int, *, per_claim: bool) -> None:
    conn = spec.raw_sqlite()
    table = f'"{spec.table}"'
    select = f"SELECT value FROM {table} WHERE key = ?"
    put = f"REPLACE INTO {table} (key, value) VALUES (?, ?)"
    upper = prefix_upper_bound(HOLDER_PREFIX)
    taken = 0
    try:
        now = system_clock()
        rows = conn.execute(
            f"SELECT key, value FROM {table} WHERE key >= ? AND key < ?", (HOLDER_PREFIX, upper)
        ).fetchall()
        if not per_claim:
            conn.execute("BEGIN IMMEDIATE")
        for holder_key, _ in rows:
            wid = holder_key[len(HOLDER_PREFIX) :]
            epoch_key = keys.workflow_owner_epoch(wid)
            if per_claim:
                conn.execute("BEGIN IMMEDIATE")
            holder = conn.execute(select, (holder_key,)).fetchone()[0]
            record = conn.execute(select, (keys.workflow(wid),)).fetchone()
            if _expired(holder, now) and _running(None if record is None else record[0]):
                epoch = (decode_epoch(conn.execute(select, (epoch_key,)).fetchone()[0]) or 0) + 1
                conn.execute(put, (epoch_key, mint_token(epoch)))
                conn.execute(put, (holder_key, _new_holder(epoch, now)))
                taken += 1
            if per_claim:
                conn.execute("COMMIT")
        if not per_claim:
            conn.execute("COMMIT")
    finally:
        conn.close()
    if taken != expected:
        raise SystemExit(f"raw sqlite took over {taken} of {expected} claims")


def raw_postgres(spec: StoreSpec, expected: int) -> None:
    table = f'"{spec.table}"'
    lock_range = (
        f"SELECT key, value FROM {table} WHERE key >= %s AND key < %s ORDER BY key FOR UPDATE"
    )
    lock_any = f"SELECT key, value FROM {table} WHERE key = ANY(%s) ORDER BY key FOR UPDATE"
    upsert = (
        f"INSERT INTO {table} (key, value) SELECT k, v FROM unnest(%s::text[], %b::bytea[]) "
        "AS u(k, v) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
    )
    conn: Any = spec.raw_postgres()
    try:
        now = system_clock()
        with conn.transaction():
            holders = conn.execute(
                lock_range, [HOLDER_PREFIX, prefix_upper_bound(HOLDER_PREFIX)]
            ).fetchall()
            ids = [str(k)[len(HOLDER_PREFIX) :] for k, _ in holders]
            epochs = dict(conn.execute(lock_any, [[keys.workflow_owner_epoch(w) for w in ids]]))
            records = dict(conn.execute(lock_any, [[keys.workflow(w) for w in ids]]).fetchall())
            put_keys: list[str] = []
            put_values: list[bytes] = []
            for wid, (holder_key, holder) in zip(ids, holders, strict=True):
                epoch_key = keys.workflow_owner_epoch(wid)
                if _expired(holder, now) and _running(records.get(keys.workflow(wid))):
                    epoch = (decode_epoch(epochs[epoch_key]) or 0) + 1
                    put_keys += [epoch_key, holder_key]
                    put_values += [mint_token(epoch), _new_holder(epoch, now)]
            conn.execute(upsert, [put_keys, put_values])
    finally:
        conn.close()
    if len(put_keys) // 2 != expected:
        raise SystemExit(f"raw postgres took over {len(put_keys) // 2} of {expected} claims")


def discovery(spec: StoreSpec, expected: int) -> None:
    with contextlib.closing(spec.open()) as storage:
        found = list_reclaim_candidates(storage, [])
    if len(found) != expected:
        raise SystemExit(f"discovery found {len(found)} of {expected} candidates")


def bench_backend(site: Site, backend: str, size: int, repeats: int) -> None:
    ids = workflow_ids(size)
    variants: dict[str, Callable[[StoreSpec], None]] = {
        "run_once": lambda spec: library_pass(spec, size),
        "discovery only": lambda spec: discovery(spec, size),
    }
    if backend == "sqlite":
        variants["raw, one txn"] = lambda spec: raw_sqlite(spec, size, per_claim=False)
        variants["raw, txn per claim"] = lambda spec: raw_sqlite(spec, size, per_claim=True)
    else:
        variants["raw, one txn"] = lambda spec: raw_postgres(spec, size)
    samples = {name: Samples() for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            spec = site.new_store(backend, name="reclaim")
            seed_stranded(spec, ids)
            samples[name].add(lambda run=run, spec=spec: run(spec))  # type: ignore[misc]
    floor = samples["raw, one txn"].median_wall
    rows = [
        [
            name,
            ms(s.median_wall),
            us(s.median_wall / size),
            ratio(s.median_wall, floor),
            ms(s.median_cpu),
        ]
        for name, s in sorted(samples.items(), key=lambda item: item[1].median_wall)
    ]
    print_table(
        f"{backend}: reclaim of {size:,} stranded claims (median of {repeats})",
        ["variant", "wall", "per claim", "/ raw one txn", "cpu (this process)"],
        rows,
    )


def main() -> None:
    args = parse_args(__doc__)
    size = 2_000 if args.quick else 10_000
    repeats = args.repeats or (1 if args.quick else 3)
    print(f"reclaim pass benchmark; {machine_note()}")
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            bench_backend(site, backend, size, repeats)


if __name__ == "__main__":
    main()
