"""Read-only listings: ``claims``, ``workflows`` and ``show``. Each opens the store read-only.

``claims`` and ``show`` print each live claim's driver state as the holder's engine published
it in its engine record (see :func:`driver_state`).

A row that does not decode, or that the store cannot return at all, is shown for what it is:
the listings mark it ``undecodable`` and name its key on stderr, ``show`` names the key and what
is wrong with it; every other row is shown as usual, and the exit code stays 0 (``doctor`` is
the command that judges the store).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TextIO, TypeVar

from ... import keys
from ...clock import system_clock
from ...codec import (
    WORKFLOW_STATUSES,
    HolderRecord,
    WorkflowRecord,
    decode_holder,
    decode_token,
    try_decode_workflow_record,
)
from ...ledger.records import checkpoint_key, decode_payload_map, result_key
from ...reclaim.engine_records import EngineRecord, decode_engine_record, read_engine_records
from ...reclaim.verdicts import stale_after_ms
from ...storage import Storage
from .output import (
    NotFound,
    StoreRef,
    UsageError,
    emit_json,
    emit_table,
    human_time,
    record_dict,
    shown,
    warn_rows,
)
from .rows import Unreadable, Value, read_value, row_problem, scan_rows

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

_T = TypeVar("_T")


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
    """One holder record found in the store; ``holder`` is ``None`` when it does not decode.

    :param problem: what is wrong with the row when ``holder`` is ``None`` (names its key).
    """

    workflow_id: str
    holder: HolderRecord | None
    problem: str | None = None

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
            "problem": self.problem,
            "driver": self.driver(now, engines),
        }


def claim_row(workflow_id: str, key: str, value: Value) -> ClaimRow:
    """The claim a holder row records."""
    holder = None if isinstance(value, Unreadable) else decode_holder(value)
    problem = None if holder is not None else row_problem(key, value, "holder record")
    return ClaimRow(workflow_id, holder, problem)


def read_claims(storage: Storage) -> list[ClaimRow]:
    """Every holder record in the store, in key order."""
    prefix = keys.workflow_owner_holder("")
    rows: list[ClaimRow] = []
    for key, value in scan_rows(storage, prefix):
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        rows.append(claim_row(workflow_id if workflow_id is not None else key, key, value))
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
    warn_rows([row.problem for row in rows if row.problem], "listed as undecodable")
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
        label = "-" if driver is None else DRIVER_LABELS[driver]
        expiry = human_time(holder.expires_at, now)
        table.append([row.workflow_id, holder.engine_id, str(holder.epoch), state, label, expiry])
    emit_table(["WORKFLOW", "HOLDER", "EPOCH", "STATE", "DRIVER", "EXPIRES"], table, out)
    return 0


@dataclass(frozen=True)
class WorkflowRow:
    """One workflow record found in the store; ``record`` is ``None`` when it does not decode.

    :param problem: what is wrong with the row when ``record`` is ``None`` (names its key).
    """

    workflow_id: str
    record: WorkflowRecord | None
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.record is not None:
            return {**record_dict(self.record), "problem": None}
        return {
            "workflow_id": self.workflow_id,
            "type": None,
            "status": "undecodable",
            "created_at": None,
            "updated_at": None,
            "revision": None,
            "input": None,
            "problem": self.problem,
        }


def _workflow_row(workflow_id: str, key: str, value: Value) -> WorkflowRow:
    record = None if isinstance(value, Unreadable) else try_decode_workflow_record(value)
    problem = None if record is not None else row_problem(key, value, "workflow record")
    return WorkflowRow(workflow_id, record, problem)


def read_workflows(storage: Storage, status: str | None, limit: int | None) -> list[WorkflowRow]:
    """Workflow records in id order, at most ``limit``, undecodable ones included.

    With ``status``, the status index is read and each entry's record is read back (an entry
    whose record decodes to another status is stale and skipped); without, every record is.
    """
    rows: list[WorkflowRow] = []
    for row in _rows_with_status(storage, status) if status else _all_rows(storage):
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _all_rows(storage: Storage) -> Iterator[WorkflowRow]:
    prefix = keys.workflow("")
    for key, value in scan_rows(storage, prefix):
        component = key[len(prefix) :]
        # An encoded id never contains ":", so a colon marks a related record (a checkpoint,
        # a result, a signal).
        workflow_id = None if ":" in component else keys.try_decode_key_component(component)
        if workflow_id is not None:
            yield _workflow_row(workflow_id, key, value)


def _rows_with_status(storage: Storage, status: str) -> Iterator[WorkflowRow]:
    prefix = keys.workflow_status_index(status, "")
    for key, _ in scan_rows(storage, prefix):  # an index entry's value is never read
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        if workflow_id is None:
            continue
        record_key = keys.workflow(workflow_id)
        value = read_value(storage, record_key)
        if value is None:
            continue
        row = _workflow_row(workflow_id, record_key, value)
        if row.record is None or row.record.status == status:
            yield row


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
        rows = read_workflows(storage, status, limit)
    warn_rows([row.problem for row in rows if row.problem], "listed as undecodable")
    if as_json:
        emit_json([row.as_dict() for row in rows], out)
        return 0
    now = system_clock()
    table = [
        [r.workflow_id, r.record.type, r.record.status, human_time(r.record.updated_at, now)]
        if r.record is not None
        else [r.workflow_id, "-", "undecodable", "-"]
        for r in rows
    ]
    emit_table(["WORKFLOW", "TYPE", "STATUS", "UPDATED"], table, out)
    return 0


@dataclass(frozen=True)
class _StoredWorkflow:
    """The rows ``show`` reads for one workflow (``None``: the row is absent)."""

    record: Value | None
    outcome: Value | None
    checkpoint: Value | None
    epoch: Value | None
    holder: Value | None
    engine: EngineRecord | None

    @classmethod
    def read(cls, storage: Storage, wid: str) -> _StoredWorkflow:
        holder = read_value(storage, keys.workflow_owner_holder(wid))
        decoded = decode_holder(holder) if isinstance(holder, bytes) else None
        engine = None
        if decoded is not None:
            engine_raw = read_value(storage, keys.engine_liveness(decoded.engine_id))
            engine = decode_engine_record(engine_raw) if isinstance(engine_raw, bytes) else None
        return cls(
            record=read_value(storage, keys.workflow(wid)),
            outcome=read_value(storage, result_key(wid)),
            checkpoint=read_value(storage, checkpoint_key(wid)),
            epoch=read_value(storage, keys.workflow_owner_epoch(wid)),
            holder=holder,
            engine=engine,
        )


def show(store: StoreRef, workflow_id: str, as_json: bool, out: TextIO) -> int:
    """Show one workflow: record, outcome, checkpoint size, epoch and holder."""
    wid = keys.validate_workflow_id(workflow_id)
    with store.open(read_only=True) as storage:
        stored = _StoredWorkflow.read(storage, wid)
    if stored.record is None and stored.epoch is None and stored.holder is None:
        raise NotFound(f"no workflow or claim {wid!r} in the store")
    data = _show_data(wid, stored, store)
    if as_json:
        emit_json(data, out)
        return 0
    _print_show(wid, data, out)
    return 0


def _show_data(wid: str, stored: _StoredWorkflow, store: StoreRef) -> dict[str, Any]:
    """What ``show --json`` prints; ``problems`` maps the key of each bad row to what is wrong."""
    problems: dict[str, str] = {}
    record = _decoded(
        problems, keys.workflow(wid), stored.record, "workflow record", try_decode_workflow_record
    )
    outcome = _decoded(
        problems, result_key(wid), stored.outcome, "workflow result", decode_payload_map
    )
    checkpoint = _decoded(problems, checkpoint_key(wid), stored.checkpoint, "checkpoint", bytes)
    epoch_key = keys.workflow_owner_epoch(wid)
    token = _decoded(problems, epoch_key, stored.epoch, "epoch", decode_token)
    if epoch_key in problems and isinstance(stored.epoch, bytes):
        repair = store.command(f"repair-epoch {wid}")
        problems[epoch_key] += f"; claims of it are refused until '{repair}' replaces it"
    holder_key = keys.workflow_owner_holder(wid)
    holder = None if stored.holder is None else claim_row(wid, holder_key, stored.holder)
    if holder is not None and holder.problem is not None:
        problems[holder_key] = holder.problem
    engines: dict[str, EngineRecord | None] = {}
    if holder is not None and holder.holder is not None:
        engines[holder.holder.engine_id] = stored.engine
    return {
        "record": record_dict(record) if record else None,
        "record_valid": stored.record is None or record is not None,
        "outcome": None if outcome is None else _outcome_dict(outcome),
        "checkpoint_bytes": None if checkpoint is None else len(checkpoint),
        "epoch": None if token is None else token.epoch,
        "epoch_valid": stored.epoch is None or token is not None,
        # The mint id of the epoch token (hex); "" for an old-format 8-byte epoch.
        "epoch_mint_id": None if token is None else token.mint_id.hex(),
        "holder": None if holder is None else holder.as_dict(system_clock(), engines),
        "problems": problems,
    }


def _decoded(
    problems: dict[str, str],
    key: str,
    value: Value | None,
    what: str,
    decode: Callable[[bytes], _T | None],
) -> _T | None:
    """``value`` decoded; ``None`` when absent, or (added to ``problems``) when it is bad."""
    if value is None:
        return None
    result = None if isinstance(value, Unreadable) else decode(value)
    if result is None:
        problems[key] = row_problem(key, value, what)
    return result


def _outcome_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    finished_at = data.get("finished_at")
    return {
        "status": str(data.get("status")),
        "result": data.get("result"),
        "error": data.get("error"),
        "finished_at": finished_at if isinstance(finished_at, int) else 0,
    }


def _print_show(wid: str, data: dict[str, Any], out: TextIO) -> None:
    now = system_clock()
    problems: dict[str, str] = data["problems"]
    lines: list[tuple[str, str]] = [("workflow", wid)]
    record = data["record"]
    if keys.workflow(wid) in problems:
        lines.append(("record", f"({problems[keys.workflow(wid)]})"))
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
    if result_key(wid) in problems:
        lines.append(("result", f"({problems[result_key(wid)]})"))
    elif outcome is not None:
        lines += [
            ("result", _compact(outcome["result"])),
            ("error", _compact(outcome["error"])),
            ("finished", human_time(outcome["finished_at"], now)),
        ]
    size = data["checkpoint_bytes"]
    if checkpoint_key(wid) in problems:
        lines.append(("checkpoint", f"({problems[checkpoint_key(wid)]})"))
    else:
        lines.append(("checkpoint", "(none)" if size is None else f"{size} bytes"))
    epoch = data["epoch"]
    if keys.workflow_owner_epoch(wid) in problems:
        lines.append(("epoch", f"(corrupt: {problems[keys.workflow_owner_epoch(wid)]})"))
    else:
        lines.append(("epoch", "(never claimed)" if epoch is None else str(epoch)))
    mint = data["epoch_mint_id"]
    if mint is not None:
        lines.append(("mint", mint or "(old 8-byte format: upgraded at the next mint)"))
    lines += _holder_lines(data["holder"], now)
    for name, value in lines:
        out.write(f"{name:<11} {shown(value)}\n")


def _holder_lines(holder: dict[str, Any] | None, now: int) -> list[tuple[str, str]]:
    if holder is None:
        return [("holder", "(none)")]
    if not holder["valid"]:
        return [("holder", f"({holder['problem']})")]
    driver = holder["driver"]
    return [
        ("holder", f"{holder['engine_id']} at epoch {holder['epoch']}"),
        ("claimed", human_time(holder["claimed_at"], now)),
        ("expires", human_time(holder["expires_at"], now)),
        ("driver", "- (expired)" if driver is None else DRIVER_LABELS[driver]),
    ]


def _compact(value: Any) -> str:
    """One line of JSON for a stored value, cut to a screen width."""
    if value is None:
        return "-"
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= 200 else text[:197] + "..."
