"""Read-only listings: ``claims``, ``workflows`` and ``show``. Each opens the store read-only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TextIO

from ... import keys
from ...clock import system_clock
from ...codec import HolderRecord, decode_holder, decode_token, try_decode_workflow_record
from ...storage import Storage
from ...workflows import Workflows
from .output import NotFound, StoreRef, emit_json, emit_table, human_time, record_dict


@dataclass(frozen=True)
class ClaimRow:
    """One holder record found in the store; ``holder`` is ``None`` when it does not decode."""

    workflow_id: str
    holder: HolderRecord | None

    def is_live(self, now: int) -> bool:
        """Whether the holder decodes and has not expired at ``now``."""
        return self.holder is not None and self.holder.expires_at >= now

    def as_dict(self, now: int) -> dict[str, Any]:
        holder = self.holder
        return {
            "workflow_id": self.workflow_id,
            "engine_id": holder.engine_id if holder else None,
            "epoch": holder.epoch if holder else None,
            "claimed_at": holder.claimed_at if holder else None,
            "expires_at": holder.expires_at if holder else None,
            "expires_in_ms": holder.expires_at - now if holder else None,
            "valid": holder is not None,
        }


def read_claims(storage: Storage) -> list[ClaimRow]:
    """Every holder record in the store, in key order."""
    prefix = keys.workflow_owner_holder("")
    rows: list[ClaimRow] = []
    for key, value in storage.scan(prefix):
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        rows.append(ClaimRow(workflow_id if workflow_id is not None else key, decode_holder(value)))
    return rows


def claims(store: StoreRef, as_json: bool, out: TextIO) -> int:
    """List every claim: workflow, holder engine, epoch, state and expiry."""
    with store.open(read_only=True) as storage:
        rows = read_claims(storage)
    now = system_clock()
    if as_json:
        emit_json([row.as_dict(now) for row in rows], out)
        return 0
    table = []
    for row in rows:
        holder = row.holder
        if holder is None:
            table.append([row.workflow_id, "(undecodable holder)", "-", "-", "-"])
            continue
        state = "live" if row.is_live(now) else "expired"
        expiry = human_time(holder.expires_at, now)
        table.append([row.workflow_id, holder.engine_id, str(holder.epoch), state, expiry])
    emit_table(["WORKFLOW", "HOLDER", "EPOCH", "STATE", "EXPIRES"], table, out)
    return 0


def workflows(
    store: StoreRef, status: str | None, limit: int | None, as_json: bool, out: TextIO
) -> int:
    """List workflow records, through the status index when a status is given."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
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
    epoch = None if token is None else token.epoch
    if record_raw is None and epoch is None and holder_raw is None:
        raise NotFound(f"no workflow or claim {wid!r} in the store")
    holder = None if holder_raw is None else decode_holder(holder_raw)
    data: dict[str, Any] = {
        "record": record_dict(record) if record else None,
        "record_valid": record_raw is None or record is not None,
        "outcome": None,
        "checkpoint_bytes": None if checkpoint is None else len(checkpoint),
        "epoch": epoch,
        # The mint id of the epoch token (hex); "" for an old-format 8-byte epoch.
        "epoch_mint_id": None if token is None else token.mint_id.hex(),
        "holder": None if holder_raw is None else ClaimRow(wid, holder).as_dict(system_clock()),
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
        lines += [
            ("holder", f"{holder['engine_id']} at epoch {holder['epoch']}"),
            ("claimed", human_time(holder["claimed_at"], now)),
            ("expires", human_time(holder["expires_at"], now)),
        ]
    for name, value in lines:
        out.write(f"{name:<11} {value}\n")


def _compact(value: Any) -> str:
    """One line of JSON for a stored value, cut to a screen width."""
    if value is None:
        return "-"
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= 200 else text[:197] + "..."
