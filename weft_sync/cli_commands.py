"""The bodies of the ``weft-sync`` commands; each returns an exit code and writes to ``out``."""

from __future__ import annotations

import argparse
import importlib
import json
import threading
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, TextIO

from . import keys
from .clock import system_clock
from .codec import decode_epoch, decode_holder, decode_mode_marker, encode_epoch
from .errors import WeftError
from .maintenance import PassResult
from .metrics import ClaimMetrics, serialize_prometheus
from .options import OwnershipOptions
from .storage import Condition, Delete, Put, Storage, open_storage
from .workflows import WorkflowNotFoundError, Workflows

__all__ = [
    "NotFound",
    "cancel",
    "claims",
    "demo",
    "doctor",
    "maintain",
    "metrics",
    "show",
    "workflows",
]


class NotFound(WeftError):
    """The workflow named on the command line does not exist."""


def _emit_json(data: Any, out: TextIO) -> None:
    json.dump(data, out, indent=2, sort_keys=True, default=str)
    out.write("\n")


def _emit_table(headers: list[str], rows: list[list[str]], out: TextIO) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    for row in [headers, *rows]:
        out.write(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        )


def _expiry_text(expires_at: int, now: int) -> str:
    delta = expires_at - now
    return f"expires in {delta / 1000:.1f}s" if delta >= 0 else f"expired {-delta / 1000:.1f}s ago"


def _claim_rows(storage: Storage, now: int) -> list[dict[str, Any]]:
    prefix = keys.workflow_owner_holder("")
    rows: list[dict[str, Any]] = []
    for key, value in storage.scan(prefix):
        workflow_id = keys.try_decode_key_component(key[len(prefix) :])
        holder = decode_holder(value)
        rows.append(
            {
                "workflow_id": workflow_id if workflow_id is not None else key,
                "engine_id": holder.engine_id if holder else None,
                "epoch": holder.epoch if holder else None,
                "expires_at": holder.expires_at if holder else None,
                "expires_in_ms": holder.expires_at - now if holder else None,
                "valid": holder is not None,
            }
        )
    return rows


def claims(url: str, as_json: bool, out: TextIO) -> int:
    """List every claim in the store."""
    now = system_clock()
    with open_storage(url) as storage:
        rows = _claim_rows(storage, now)
    if as_json:
        _emit_json(rows, out)
        return 0
    table = [
        [
            str(r["workflow_id"]),
            str(r["engine_id"]) if r["valid"] else "(undecodable holder)",
            str(r["epoch"] or "-"),
            _expiry_text(r["expires_at"], now) if r["valid"] else "-",
        ]
        for r in rows
    ]
    _emit_table(["WORKFLOW", "HOLDER", "EPOCH", "EXPIRY"], table, out)
    return 0


def _record_dict(record: Any) -> dict[str, Any]:
    return {
        "workflow_id": record.workflow_id,
        "type": record.type,
        "status": record.status,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "revision": record.revision,
        "input": record.input,
    }


def workflows(url: str, status: str | None, limit: int | None, as_json: bool, out: TextIO) -> int:
    """List workflow records, through the status index when a status is given."""
    with open_storage(url) as storage:
        records = Workflows(storage).list(status=status, limit=limit)
    if as_json:
        _emit_json([_record_dict(r) for r in records], out)
        return 0
    rows = [[r.workflow_id, r.type, r.status, str(r.updated_at)] for r in records]
    _emit_table(["WORKFLOW", "TYPE", "STATUS", "UPDATED_AT"], rows, out)
    return 0


def show(url: str, workflow_id: str, as_json: bool, out: TextIO) -> int:
    """Show one workflow record, its epoch and its holder."""
    keys.validate_workflow_id(workflow_id)
    now = system_clock()
    with open_storage(url) as storage:
        record = Workflows(storage).get(workflow_id)
        epoch = decode_epoch(storage.get(keys.workflow_owner_epoch(workflow_id)))
        holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    if record is None and epoch is None:
        raise NotFound(f"no workflow {workflow_id!r} in the store")
    data: dict[str, Any] = {"record": _record_dict(record) if record else None, "epoch": epoch}
    data["holder"] = (
        {
            "engine_id": holder.engine_id,
            "epoch": holder.epoch,
            "expires_at": holder.expires_at,
            "claimed_at": holder.claimed_at,
        }
        if holder
        else None
    )
    if as_json:
        _emit_json(data, out)
        return 0
    if record is not None:
        out.write(f"workflow  {record.workflow_id}\ntype      {record.type}\n")
        out.write(f"status    {record.status}\nupdated   {record.updated_at}\n")
    out.write(f"epoch     {epoch if epoch is not None else '(never claimed)'}\n")
    if holder is not None:
        out.write(f"holder    {holder.engine_id} ({_expiry_text(holder.expires_at, now)})\n")
    else:
        out.write("holder    (none)\n")
    return 0


def _load_handler(spec: str) -> Callable[[str], object]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--handler must be MODULE:FUNCTION, got {spec!r}")
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load --handler {spec!r}: {exc}") from None
    if not callable(handler):
        raise ValueError(f"--handler {spec!r} is not callable")
    return handler  # type: ignore[no-any-return]


StopSignals = Callable[[], AbstractContextManager[threading.Event]]
"""Returns a context manager yielding an event set on SIGTERM or SIGINT while it is open."""


def maintain(url: str, args: argparse.Namespace, out: TextIO, stop_signals: StopSignals) -> int:
    """Run maintenance once (cron) or on an interval until SIGTERM / Ctrl-C."""
    from .ownership import Ownership

    options = OwnershipOptions(claim_ttl=args.claim_ttl, claim_renew_interval=args.renew_interval)
    handler = _load_handler(args.handler) if args.handler else None
    types = set(args.types)

    def eligible(workflow_type: str, revision: str | None) -> bool:
        return handler is not None and (not types or workflow_type in types)

    def open_engine(background: Literal["thread", "manual"]) -> Ownership:
        return Ownership.open(
            url, options=options, on_reclaimed=handler, is_eligible=eligible, background=background
        )

    if args.once:
        with open_engine("manual") as ownership:
            return _maintain_once(ownership.run_maintenance(), args.json, handler is None, out)
    # The handlers go in before the engine starts and come out after it closed, so a signal at
    # any moment ends in a clean close, never in the default handler's abrupt exit.
    with stop_signals() as stop, open_engine("thread") as ownership:
        out.write(f"maintaining {url} as engine {ownership.engine_id}; Ctrl-C or SIGTERM stops\n")
        out.flush()
        stop.wait()
        out.write("stopping: releasing claims\n")
        out.flush()
    return 0


def _maintain_once(result: PassResult, as_json: bool, no_handler: bool, out: TextIO) -> int:
    reclaim = result.reclaim
    summary = {
        "renewed": result.renewed_count,
        "failed": result.failed_count,
        "reclaim_status": str(reclaim.status.value) if reclaim else None,
        "reclaimed": reclaim.reclaimed_count if reclaim else 0,
        "candidates": len(reclaim.outcomes) if reclaim else 0,
    }
    discovery_failed = reclaim is not None and reclaim.status == "discovery-failed"
    if as_json:
        _emit_json(summary, out)
    else:
        out.write(
            f"renewed {summary['renewed']}, failed {summary['failed']}, reclaimed "
            f"{summary['reclaimed']} of {summary['candidates']} candidates\n"
        )
        if no_handler and summary["candidates"]:
            out.write("no --handler given, so no workflow was taken over\n")
    if discovery_failed:
        assert reclaim is not None
        out.write(f"reclaim discovery failed: {reclaim.error}\n")
        return 1
    return 0


def metrics(url: str, out: TextIO) -> int:
    """Print Prometheus text: the claim metric families and store-wide claim gauges.

    Read-only: no engine is bootstrapped and no maintenance pass runs, since a pass would take
    over every expired claim in the store. The per-engine families are exported by the engines
    themselves; here they come from a fresh engine holding nothing, so every family and its
    ``TYPE`` line is present for a scraper.
    """
    now = system_clock()
    with open_storage(url) as storage:
        rows = _claim_rows(storage, now)
    live = sum(1 for r in rows if r["valid"] and r["expires_in_ms"] >= 0)
    out.write(serialize_prometheus(ClaimMetrics().snapshot()))
    out.write("# HELP weft_store_claims Claims recorded in the store, by state\n")
    out.write("# TYPE weft_store_claims gauge\n")
    out.write(f'weft_store_claims{{state="live"}} {live}\n')
    out.write(f'weft_store_claims{{state="expired_or_invalid"}} {len(rows) - live}\n')
    return 0


def doctor(url: str, out: TextIO) -> int:
    """Check the store: reachable, a real compare-and-swap, the mode marker, clock sanity."""
    problems = 0

    def report(ok: bool, line: str) -> None:
        nonlocal problems
        problems += 0 if ok else 1
        out.write(f"[{'ok' if ok else 'FAIL'}] {line}\n")

    with open_storage(url) as storage:
        report(True, f"store reachable: {url}")
        caps = storage.capabilities
        report(caps.conditional_batch, f"declares compare-and-swap (multi_host={caps.multi_host})")
        probe = f"weft-doctor:{uuid.uuid4().hex}"
        first = storage.conditional_batch([Condition(probe, None)], [Put(probe, encode_epoch(1))])
        second = storage.conditional_batch([Condition(probe, None)], [Put(probe, encode_epoch(2))])
        storage.conditional_batch([], [Delete(probe)])
        report(first and not second, "compare-and-swap refuses a stale expectation")
        raw = storage.get(keys.OWNERSHIP_MODE_MARKER)
        marker = decode_mode_marker(raw)
        if raw is None:
            report(True, "mode marker: absent (the first engine stamps it)")
        elif marker is None:
            report(False, "mode marker: present but corrupt; an operator must repair it")
        else:
            report(marker.mode == "workflow-lease", f"mode marker: {marker.mode!r}")
        now = system_clock()
        future = [r for r in _claim_rows(storage, now) if r["valid"]]
        skewed = [r for r in future if r["expires_at"] - now > 24 * 3600 * 1000]
        report(
            not skewed,
            f"clock sanity: {len(skewed)} of {len(future)} claims expire more than a day ahead",
        )
        _report_replication(storage, report)
    out.write("no problems found\n" if problems == 0 else f"{problems} problem(s) found\n")
    return 0 if problems == 0 else 1


def _report_replication(storage: object, report: Callable[[bool, str], None]) -> None:
    """Print how the server replicates commits (PostgreSQL only): an asynchronous failover can
    roll an epoch back and so hand a fence out twice. A standby cannot take writes at all."""
    settings_of = getattr(storage, "replication_settings", None)
    if not callable(settings_of):
        return
    settings = settings_of()
    durability = "survive" if settings.failover_safe else "may be lost in"
    report(
        not settings.is_standby,
        f"replication: synchronous_commit={settings.synchronous_commit}, "
        f"synchronous_standby_names={settings.synchronous_standby_names!r}, "
        f"standby={settings.is_standby}; acknowledged epochs {durability} a failover",
    )


def cancel(url: str, workflow_id: str, out: TextIO) -> int:
    """Cancel a workflow from outside; its owner (if any) is deposed."""
    keys.validate_workflow_id(workflow_id)
    with open_storage(url) as storage:
        ledger = Workflows(storage)
        try:
            record = ledger.cancel(workflow_id)
        except WorkflowNotFoundError:
            raise NotFound(f"no workflow {workflow_id!r} in the store") from None
        epoch = decode_epoch(storage.get(keys.workflow_owner_epoch(workflow_id)))
    out.write(f"{record.workflow_id}: {record.status} (epoch now {epoch})\n")
    return 0


def demo(workers: int, workflow_count: int, out: TextIO) -> int:
    """Run the multi-process takeover demonstration."""
    from .demo import DemoSettings, run_demo

    if workers < 2 or workflow_count < 1:
        raise ValueError(
            f"demo needs --workers >= 2 and --workflows >= 1, got {workers}, {workflow_count}"
        )

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    return run_demo(say, DemoSettings(workers=workers, workflows=workflow_count))
