"""Read-only listings: ``claims``, ``workflows`` and ``show``. Each opens the store read-only.

``claims`` and ``show`` print each live claim's driver state as the holder's engine published
it in its engine record (see :func:`driver_state`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TextIO

from ... import keys
from ...clock import system_clock
from ...codec import (
    WORKFLOW_STATUSES,
    HolderRecord,
    decode_holder,
    decode_token,
    try_decode_workflow_record,
)
from ...reclaim.engine_records import EngineRecord, decode_engine_record, read_engine_records
from ...reclaim.verdicts import stale_after_ms
from ...storage import Storage
from ...workflows import Workflows
from .output import (
    NotFound,
    StoreRef,
    UsageError,
    emit_json,
    emit_table,
    human_time,
    record_dict,
)

DriverState = Literal["driven", "awaiting", "no-driver", "unknown"]
"""A live claim's driver state, as ``--json`` writes it."""

DRIVER_LABELS: Final[Mapping[DriverState, str]] = {
    "driven": "driven",
    "awaiting": "awaiting driver",
    "no-driver": "no driver",
    "unknown": "unknown",
}
"""How the tables print each :data:`DriverState`."""

EngineRecords = Mapping[str, EngineRecord | None]
"""Engine records by engine id; ``None`` for a record that does not decode."""


def driver_state(
    workflow_id: str, holder: HolderRecord, engine: EngineRecord | None, now: int
) -> DriverState:
    """What the holder's engine last published about the driver of its claim on ``workflow_id``.

    ``no-driver`` when its record lists the claim so, or says the engine closed (what a closed
    engine left behind is driven by nobody); ``awaiting`` when it lists the claim as awaiting a
    driver; ``unknown`` when there is no record to go by — none, one that does not decode, one
    whose heartbeat is stale at ``now``, one written before the claim was taken (or by an
    engine started after it: a previous engine under the same id), or one whose lists were cut
    short without naming it; ``driven`` otherwise. An engine that publishes no driver state (an
    older version) reads as ``driven``.
    """
    if engine is None or engine.engine_id != holder.engine_id:
        return "unknown"
    if engine.state == "closed":
        return "no-driver"
    if not engine.started_at <= holder.claimed_at <= engine.heartbeat_at:
        return "unknown"
    if now - engine.heartbeat_at > stale_after_ms(engine):
        return "unknown"
    undriven = engine.undriven
    if undriven is None:
        return "driven"
    if workflow_id in undriven.no_driver:
        return "no-driver"
    if workflow_id in undriven.awaiting:
        return "awaiting"
    return "driven" if undriven.complete else "unknown"


@dataclass(frozen=True)
class ClaimRow:
    """One holder record found in the store; ``holder`` is ``None`` when it does not decode."""

    workflow_id: str
    holder: HolderRecord | None

    def is_live(self, now: int) -> bool:
        """Whether the holder decodes and has not expired at ``now``."""
        return self.holder is not None and self.holder.expires_at >= now

    def driver(self, now: int, engines: EngineRecords) -> DriverState | None:
        """The claim's driver state (see :func:`driver_state`); ``None`` unless it is live."""
        holder = self.holder
        if holder is None or not self.is_live(now):
            return None
        return driver_state(self.workflow_id, holder, engines.get(holder.engine_id), now)

    def as_dict(self, now: int, engines: EngineRecords) -> dict[str, Any]:
        holder = self.holder
        return {
            "workflow_id": self.workflow_id,
            "engine_id": holder.engine_id if holder else None,
            "epoch": holder.epoch if holder else None,
            "claimed_at": holder.claimed_at if holder else None,
            "expires_at": holder.expires_at if holder else None,
            "expires_in_ms": holder.expires_at - now if holder else None,
            "valid": holder is not None,
            "driver": self.driver(now, engines),
        }


def read_claims(storage: Storage) -> list[ClaimRow]:
    """Every holder record in the store, in key order."""
    prefix = keys.workflow_owner_holder("")
    rows: list[ClaimRow] = []
    for key, value in storage.scan(prefix):
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        rows.append(ClaimRow(workflow_id if workflow_id is not None else key, decode_holder(value)))
    return rows


def read_engines(storage: Storage) -> dict[str, EngineRecord | None]:
    """Every engine record in the store by engine id (one scan of a row per engine)."""
    return {engine_id: record for engine_id, _, record in read_engine_records(storage)}


def claims(store: StoreRef, as_json: bool, out: TextIO) -> int:
    """List every claim: workflow, holder engine, epoch, state, driver state and expiry."""
    with store.open(read_only=True) as storage:
        rows = read_claims(storage)
        engines = read_engines(storage)
    now = system_clock()
    if as_json:
        emit_json([row.as_dict(now, engines) for row in rows], out)
        return 0
    table = []
    for row in rows:
        holder = row.holder
        if holder is None:
            table.append([row.workflow_id, "(undecodable holder)", "-", "-", "-", "-"])
            continue
        state = "live" if row.is_live(now) else "expired"
        driver = row.driver(now, engines)
        shown = "-" if driver is None else DRIVER_LABELS[driver]
        expiry = human_time(holder.expires_at, now)
        table.append([row.workflow_id, holder.engine_id, str(holder.epoch), state, shown, expiry])
    emit_table(["WORKFLOW", "HOLDER", "EPOCH", "STATE", "DRIVER", "EXPIRES"], table, out)
    return 0


def workflows(
    store: StoreRef, status: str | None, limit: int | None, as_json: bool, out: TextIO
) -> int:
    """List workflow records, through the status index when a status is given."""
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    # Before the store opens: a usage error, not a missing store, is what the operator must fix.
    if status is not None and status not in WORKFLOW_STATUSES:
        raise UsageError(f"--status must be one of {', '.join(WORKFLOW_STATUSES)}, got {status!r}")
    with store.open(read_only=True) as storage:
        records = Workflows(storage).list(status=status, limit=limit)
    if as_json:
        emit_json([record_dict(r) for r in records], out)
        return 0
    now = system_clock()
    rows = [[r.workflow_id, r.type, r.status, human_time(r.updated_at, now)] for r in records]
    emit_table(["WORKFLOW", "TYPE", "STATUS", "UPDATED"], rows, out)
    return 0


def show(store: StoreRef, workflow_id: str, as_json: bool, out: TextIO) -> int:
    """Show one workflow: record, outcome, checkpoint size, epoch and holder."""
    wid = keys.validate_workflow_id(workflow_id)
    with store.open(read_only=True) as storage:
        ledger = Workflows(storage)
        record_raw = storage.get(keys.workflow(wid))
        record = try_decode_workflow_record(record_raw)
        outcome = ledger.get_outcome(wid)
        checkpoint = ledger.load_checkpoint(wid)
        token = decode_token(storage.get(keys.workflow_owner_epoch(wid)))
        holder_raw = storage.get(keys.workflow_owner_holder(wid))
        holder = None if holder_raw is None else decode_holder(holder_raw)
        engines: dict[str, EngineRecord | None] = {}
        if holder is not None:
            engine_raw = storage.get(keys.engine_liveness(holder.engine_id))
            engines[holder.engine_id] = decode_engine_record(engine_raw)
    epoch = None if token is None else token.epoch
    if record_raw is None and epoch is None and holder_raw is None:
        raise NotFound(f"no workflow or claim {wid!r} in the store")
    now = system_clock()
    data: dict[str, Any] = {
        "record": record_dict(record) if record else None,
        "record_valid": record_raw is None or record is not None,
        "outcome": None,
        "checkpoint_bytes": None if checkpoint is None else len(checkpoint),
        "epoch": epoch,
        # The mint id of the epoch token (hex); "" for an old-format 8-byte epoch.
        "epoch_mint_id": None if token is None else token.mint_id.hex(),
        "holder": None if holder_raw is None else ClaimRow(wid, holder).as_dict(now, engines),
    }
    if outcome is not None:
        data["outcome"] = {
            "status": outcome.status,
            "result": outcome.result,
            "error": outcome.error,
            "finished_at": outcome.finished_at,
        }
    if as_json:
        emit_json(data, out)
        return 0
    _print_show(wid, data, out)
    return 0


def _print_show(wid: str, data: dict[str, Any], out: TextIO) -> None:
    now = system_clock()
    lines: list[tuple[str, str]] = [("workflow", wid)]
    record = data["record"]
    if not data["record_valid"]:
        lines.append(("record", "(undecodable workflow record)"))
    elif record is None:
        lines.append(("record", "(none: a bare claim)"))
    else:
        lines += [
            ("type", record["type"]),
            ("status", record["status"]),
            ("created", human_time(record["created_at"], now)),
            ("updated", human_time(record["updated_at"], now)),
            ("input", _compact(record["input"])),
        ]
    outcome = data["outcome"]
    if outcome is not None:
        lines += [
            ("result", _compact(outcome["result"])),
            ("error", _compact(outcome["error"])),
            ("finished", human_time(outcome["finished_at"], now)),
        ]
    size = data["checkpoint_bytes"]
    lines.append(("checkpoint", "(none)" if size is None else f"{size} bytes"))
    epoch = data["epoch"]
    lines.append(("epoch", "(never claimed)" if epoch is None else str(epoch)))
    mint = data["epoch_mint_id"]
    if mint is not None:
        lines.append(("mint", mint or "(old 8-byte format: upgraded at the next mint)"))
    holder = data["holder"]
    if holder is None:
        lines.append(("holder", "(none)"))
    elif not holder["valid"]:
        lines.append(("holder", "(undecodable holder record)"))
    else:
        driver = holder["driver"]
        lines += [
            ("holder", f"{holder['engine_id']} at epoch {holder['epoch']}"),
            ("claimed", human_time(holder["claimed_at"], now)),
            ("expires", human_time(holder["expires_at"], now)),
            ("driver", "- (expired)" if driver is None else DRIVER_LABELS[driver]),
        ]
    for name, value in lines:
        out.write(f"{name:<11} {value}\n")


def _compact(value: Any) -> str:
    """One line of JSON for a stored value, cut to a screen width."""
    if value is None:
        return "-"
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= 200 else text[:197] + "..."
