"""Seeding for ``bench/scale.py``: live claims of other engines written as raw rows, in bulk.

A claim seeded here is byte for byte what the library writes when an engine acquires a workflow it
started: the epoch key (``mint_token``: the epoch number and a random mint id, so the check
compares that row by its number and length), the holder record (``encode_holder``), the running
workflow record (``encode_workflow_record``) and its status-index entry, and the by-engine index
entry (engine, workflow) -> the epoch number (``encode_epoch``). Rows go in with one bulk
transaction per chunk: SQLite ``executemany`` on a plain ``sqlite3`` connection to the same file
and table (values are stored as the raw bytes, as ``SqliteStorage`` stores them), PostgreSQL
``COPY``.

A store lives either in a temporary directory (gone after the run) or in ``--keep DIR``, where a
manifest remembers its table and how many claims were seeded, so a later run adds only what a
larger size needs.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import StoreSpec
from weft_sync import Ownership, keys
from weft_sync.codec import (
    HolderRecord,
    WorkflowRecord,
    decode_epoch,
    decode_holder,
    encode_epoch,
    encode_holder,
    encode_workflow_record,
    mint_token,
    try_decode_workflow_record,
)
from weft_sync.storage.base import prefix_upper_bound

__all__ = [
    "SEED_TYPE",
    "Seeder",
    "check_seed_format",
    "claim_rows",
    "drop_kept",
    "kept_store",
    "save_manifest",
]

SEED_TYPE = "scale-job"
SEED_CHUNK = 20_000
FAR_FUTURE_MS = 4_000_000_000_000  # year 2096: never expires during a run


def claim_rows(
    workflow_id: str,
    engine_id: str,
    *,
    expires_at: int,
    claimed_at: int,
    created_at: int | None = None,
) -> list[tuple[str, bytes]]:
    """The five rows of one running workflow held by ``engine_id`` at epoch 1.

    :param created_at: the workflow record's timestamps (default ``claimed_at``).
    """
    holder = encode_holder(HolderRecord(engine_id, 1, expires_at, claimed_at))
    at = claimed_at if created_at is None else created_at
    record = WorkflowRecord(workflow_id, SEED_TYPE, "running", created_at=at, updated_at=at)
    return [
        (keys.workflow_owner_epoch(workflow_id), mint_token(1)),
        (keys.workflow_owner_holder(workflow_id), holder),
        (keys.workflow(workflow_id), encode_workflow_record(record)),
        (keys.workflow_status_index("running", workflow_id), b""),
        (keys.workflow_owner_by_engine(engine_id, workflow_id), encode_epoch(1)),
    ]


@dataclass
class Seeder:
    """Writes raw rows into one store's table, and reads back what a bench must check."""

    spec: StoreSpec

    @contextlib.contextmanager
    def _sqlite(self) -> Iterator[sqlite3.Connection]:
        conn = self.spec.raw_sqlite()
        try:
            yield conn
        finally:
            conn.close()

    def insert(self, rows: Sequence[tuple[str, bytes]]) -> None:
        """Insert ``rows`` (keys absent so far) in one transaction per chunk."""
        table = f'"{self.spec.table}"'
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                for start in range(0, len(rows), 5 * SEED_CHUNK):
                    conn.execute("BEGIN IMMEDIATE")
                    conn.executemany(
                        f"INSERT INTO {table} (key, value) VALUES (?, ?)",
                        rows[start : start + 5 * SEED_CHUNK],
                    )
                    conn.execute("COMMIT")
            return
        with self.spec.raw_postgres() as conn:
            for start in range(0, len(rows), 5 * SEED_CHUNK):
                with (
                    conn.transaction(),
                    conn.cursor() as cur,
                    cur.copy(f"COPY {table} (key, value) FROM STDIN") as copy,
                ):
                    for row in rows[start : start + 5 * SEED_CHUNK]:
                        copy.write_row(row)

    def seed_claims(
        self,
        workflow_ids: Sequence[str],
        engines: Sequence[str],
        *,
        expires_at: int = FAR_FUTURE_MS,
        claimed_at: int | None = None,
    ) -> float:
        """Seed one claim per id, engines taken round-robin; return the seconds it took."""
        started = time.perf_counter()
        at = int(time.time() * 1000) if claimed_at is None else claimed_at
        for start in range(0, len(workflow_ids), SEED_CHUNK):
            rows: list[tuple[str, bytes]] = []
            for offset, wid in enumerate(workflow_ids[start : start + SEED_CHUNK]):
                engine = engines[(start + offset) % len(engines)]
                rows += claim_rows(wid, engine, expires_at=expires_at, claimed_at=at)
            self.insert(rows)
        return time.perf_counter() - started

    def count_prefix(self, prefix: str) -> int:
        """How many keys of the table start with ``prefix``."""
        upper = prefix_upper_bound(prefix)
        table = f'"{self.spec.table}"'
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                row = conn.execute(
                    f"SELECT count(*) FROM {table} WHERE key >= ? AND key < ?", (prefix, upper)
                ).fetchone()
                return int(row[0])
        with self.spec.raw_postgres() as conn:
            found = conn.execute(
                f"SELECT count(*) FROM {table} WHERE key >= %s AND key < %s", (prefix, upper)
            ).fetchone()
            return int(found[0])

    def read_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        upper = prefix_upper_bound(prefix)
        table = f'"{self.spec.table}"'
        query = f"SELECT key, value FROM {table} WHERE key >= {{p}} AND key < {{p}} ORDER BY key"
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                rows = conn.execute(query.format(p="?"), (prefix, upper)).fetchall()
        else:
            with self.spec.raw_postgres() as conn:
                rows = conn.execute(query.format(p="%s"), (prefix, upper)).fetchall()
        return [(str(k), bytes(v)) for k, v in rows]

    def delete_keys(self, doomed: Sequence[str]) -> None:
        table = f'"{self.spec.table}"'
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(f"DELETE FROM {table} WHERE key = ?", [(k,) for k in doomed])
                conn.execute("COMMIT")
            return
        with self.spec.raw_postgres() as conn:
            conn.execute(f"DELETE FROM {table} WHERE key = ANY(%s)", (list(doomed),))

    def delete_prefixes(self, prefixes: Sequence[str]) -> None:
        """Delete every key starting with one of ``prefixes``, in one transaction."""
        table = f'"{self.spec.table}"'
        bounds = [(p, prefix_upper_bound(p)) for p in prefixes]
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(f"DELETE FROM {table} WHERE key >= ? AND key < ?", bounds)
                conn.execute("COMMIT")
            return
        with self.spec.raw_postgres() as conn, conn.transaction(), conn.cursor() as cur:
            cur.executemany(f"DELETE FROM {table} WHERE key >= %s AND key < %s", bounds)

    def drop(self) -> None:
        """Drop a PostgreSQL store's table (a million claims are a gigabyte on a shared server).

        SQLite files go with their temporary directory.
        """
        if self.spec.backend == "postgres":
            with self.spec.raw_postgres() as conn:
                conn.execute(f'DROP TABLE IF EXISTS "{self.spec.table}"')

    def vacuum_analyze(self) -> None:
        """Refresh the planner's statistics after a bulk load (PostgreSQL; SQLite: ANALYZE)."""
        table = f'"{self.spec.table}"'
        if self.spec.backend == "sqlite":
            with self._sqlite() as conn:
                conn.execute(f"ANALYZE {table}")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return
        with self.spec.raw_postgres() as conn:
            conn.execute(f"VACUUM ANALYZE {table}")


def check_seed_format(seeder: Seeder, ownership: Ownership) -> None:
    """Start one workflow through the library and check its rows are what seeding writes.

    Every key holding the probe's id is compared, so a row the library writes and seeding does
    not (or the other way round) stops the benchmark. The probe's rows are removed afterwards.
    """
    wid = f"scale-probe-{uuid.uuid4().hex[:8]}"
    enc = keys.encode_key_component(wid)
    # The probe's own key families, and the whole by-engine range of an engine that holds
    # nothing else, so an entry under an unexpected key would show too.
    prefixes = [
        keys.workflow_owner_epoch(wid),
        keys.workflow_owner_holder(wid),
        keys.workflow(wid),
        keys.workflow_status_index("running", wid),
        keys.workflow_owner_by_engine_prefix(ownership.engine_id),
    ]
    ownership.workflows.start(wid, SEED_TYPE)
    try:
        written = {k: v for p in prefixes for k, v in seeder.read_prefix(p) if enc in k}
        holder = decode_holder(written.get(keys.workflow_owner_holder(wid)))
        record = try_decode_workflow_record(written.get(keys.workflow(wid)))
        if holder is None or record is None:
            raise SystemExit(f"the probe workflow {wid!r} has no holder or record: {written}")
        expected = dict(
            claim_rows(
                wid,
                ownership.engine_id,
                expires_at=holder.expires_at,
                claimed_at=holder.claimed_at,
                created_at=record.created_at,
            )
        )
        # The mint id of a token is random: the epoch rows match by number and length.
        epoch_key = keys.workflow_owner_epoch(wid)
        token, seeded = written.get(epoch_key, b""), expected[epoch_key]
        if len(token) == len(seeded) and decode_epoch(token) == decode_epoch(seeded):
            expected[epoch_key] = token
        if written != expected:
            raise SystemExit(
                f"seeded rows differ from what the library writes:\n library {written}\n"
                f" seeding {expected}"
            )
    finally:
        ownership.workflows.complete(wid)
        # The completed record, its index entry and the epoch stay behind: remove them.
        prefixes.append(keys.workflow_status_index("completed", wid))
        seeder.delete_keys([k for p in prefixes for k, _ in seeder.read_prefix(p) if enc in k])


# -- kept stores ----------------------------------------------------------------------------


def kept_store(keep: Path, backend: str, pg_url: str | None) -> tuple[StoreSpec, dict[str, Any]]:
    """The store kept in ``keep`` for ``backend`` and its manifest (empty for a new store).

    The manifest (``keep/<backend>.json``) holds the table name and the seeded claim count;
    never the server URL, which comes from the environment on every run.
    """
    keep.mkdir(parents=True, exist_ok=True)
    manifest_path = keep / f"{backend}.json"
    manifest: dict[str, Any] = {}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
    table = str(manifest.get("table") or "scale_" + uuid.uuid4().hex[:12])
    manifest["table"] = table
    if backend == "sqlite":
        path = str(keep / "scale.db")
        spec = StoreSpec(backend, f"sqlite:///{path}?table={table}", table, path=path)
    else:
        if pg_url is None:
            raise SystemExit("--backend postgres needs a server: set WEFT_SYNC_TEST_POSTGRES_DSN")
        sep = "&" if "?" in pg_url else "?"
        spec = StoreSpec(backend, f"{pg_url}{sep}table={table}", table, dsn=pg_url)
    return spec, manifest


def drop_kept(keep: Path, pg_url: str | None) -> None:
    """Remove the stores kept in ``keep``: the PostgreSQL table, the SQLite files, the manifests."""
    pg_manifest = keep / "postgres.json"
    if pg_manifest.exists():
        if pg_url is None:
            raise SystemExit("dropping the kept PostgreSQL table needs WEFT_SYNC_TEST_POSTGRES_DSN")
        table = json.loads(pg_manifest.read_text())["table"]
        spec = StoreSpec("postgres", "", table, dsn=pg_url)
        with spec.raw_postgres() as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        pg_manifest.unlink()
    for path in keep.glob("scale.db*"):  # the database, its WAL files, its session-lock directory
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    (keep / "sqlite.json").unlink(missing_ok=True)


def save_manifest(keep: Path, backend: str, manifest: dict[str, Any]) -> None:
    (keep / f"{backend}.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
