"""Shared pieces of the engine-discovery tests: timing, a recording handler, store readers.

Everything here reads or writes a real store the way the library (or an older version of it)
does; :class:`ReadCounting` only counts what passes through to the real store.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from weft_sync import keys
from weft_sync.claims.engine_index import backfill_step
from weft_sync.codec import HolderRecord, decode_holder
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import ReclaimedWorkflow
from weft_sync.reclaim.engine_records import (
    EngineRecord,
    decode_engine_record,
    encode_engine_record,
)
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_EXPIRY_MS = TTL_MS + 2 * RENEW_MS + 1
"""From a claim's acquire (or last renewal) until a takeover may take it by expiry."""
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
JOB = "job"


class Driven:
    """A handler that records which engine drove which workflow and leaves it running."""

    def __init__(self) -> None:
        # _lock guards by_engine.
        self._lock = threading.Lock()
        self.by_engine: dict[str, list[str]] = {}

    def __call__(self, ctx: ReclaimedWorkflow) -> None:
        with self._lock:
            self.by_engine.setdefault(ctx.ownership.engine_id, []).append(ctx.workflow_id)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {engine: len(ids) for engine, ids in self.by_engine.items()}

    def all_ids(self) -> list[str]:
        with self._lock:
            return sorted(wid for ids in self.by_engine.values() for wid in ids)


def holder(storage: Storage, workflow_id: str) -> HolderRecord | None:
    """The decoded holder of ``workflow_id``, or ``None``."""
    return decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))


def holders(storage: Storage, ids: Sequence[str]) -> dict[str, tuple[str, int] | None]:
    """``{id: (engine, epoch)}`` for ``ids`` (``None`` for an id nobody holds)."""
    found: dict[str, tuple[str, int] | None] = {}
    for wid in ids:
        record = holder(storage, wid)
        found[wid] = None if record is None else (record.engine_id, record.epoch)
    return found


def engine_record(storage: Storage, engine_id: str) -> EngineRecord | None:
    return decode_engine_record(storage.get(keys.engine_liveness(engine_id)))


def rewrite_record(storage: Storage, engine_id: str, **changes: Any) -> EngineRecord:
    """Overwrite ``engine_id``'s liveness record with ``changes`` applied; return the new one."""
    record = engine_record(storage, engine_id)
    assert record is not None, f"engine {engine_id} has no record"
    changed = dataclasses.replace(record, **changes)
    storage.put(keys.engine_liveness(engine_id), encode_engine_record(changed))
    return changed


def index_store(storage: Storage, budget: int = 10_000) -> None:
    """Run the by-engine backfill to its end, so that the store carries the index marker."""
    cursor: str | None = None
    for _ in range(50):
        step = backfill_step(storage, cursor=cursor, budget=budget)
        if step.done:
            return
        cursor = step.cursor
    raise AssertionError("the backfill did not finish")


class ReadCounting:
    """Forwards to a real store and counts the rows it hands back, per kind of read."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        # _lock guards the counters.
        self._lock = threading.Lock()
        self.scanned: dict[str, int] = {}
        self.got: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    def reset(self) -> None:
        with self._lock:
            self.scanned = {}
            self.got = []

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self.got.append(key)
        return self._inner.get(key)

    def get_many(self, keys_: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            self.got.extend(keys_)
        getter = getattr(self._inner, "get_many", None)
        if getter is None:
            return [self._inner.get(key) for key in keys_]
        values: list[bytes | None] = getter(keys_)
        return values

    def scan(self, prefix: str = "", **bounds: Any) -> list[tuple[str, bytes]]:
        rows = self._inner.scan(prefix, **bounds)
        with self._lock:
            self.scanned[prefix] = self.scanned.get(prefix, 0) + len(rows)
        return rows

    def rows_read(self) -> int:
        with self._lock:
            return sum(self.scanned.values()) + len(self.got)
