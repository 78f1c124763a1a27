"""``doctor``: check a store without changing it; ``doctor --fix`` may create what is missing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Final, TextIO

from ... import keys
from ...codec import decode_epoch, decode_mode_marker, encode_epoch
from ...storage import Condition, Delete, Put, Storage
from ...storage.postgres.settings import ReplicationSettings
from .listing import read_claims
from .output import CommandError, StoreMissing, StoreRef, one_line
from .rows import Unreadable, Value, read_value, scan_rows
from .store_view import read_store_view

CLOCK_SKEW_LIMIT_MS: Final = 24 * 3600 * 1000
"""A claim expiring further ahead than this was written by a clock that is far off."""

CORRUPT_EPOCHS_SHOWN: Final = 20
"""Corrupt epoch keys named one by one; more are only counted."""

Report = Callable[[str, str], None]


def doctor(store: StoreRef, fix: bool, out: TextIO) -> int:
    """Report each check as ``[ok]``, ``[FAIL]`` or ``[info]``; exit 1 if any failed.

    Without ``fix`` the store is opened read-only: a missing file or table is reported, never
    created, and the compare-and-swap probe (a write) is skipped.
    """
    problems = 0

    def report(verdict: str, line: str) -> None:
        nonlocal problems
        problems += verdict == "FAIL"
        out.write(f"[{verdict}] {line}\n")

    mode = "read-write, may create the table" if fix else "read-only"
    out.write(f"checking {store.shown} ({mode})\n")
    try:
        storage = store.open(read_only=not fix, create=fix)
    except CommandError as exc:
        report("FAIL", f"open the store: {one_line(str(exc))}")
        out.write(f"1 problem(s) found{_open_hint(exc, store)}\n")
        return 1
    with storage:
        report("ok", "open the store: the file or table exists and answers reads")
        _check_store(storage, fix, report, store)
    out.write("no problems found\n" if problems == 0 else f"{problems} problem(s) found\n")
    return 0 if problems == 0 else 1


def _open_hint(exc: CommandError, store: StoreRef) -> str:
    """What to do about a store that did not open, when the command line knows."""
    if not isinstance(exc, StoreMissing):
        return ""
    if not exc.fixable:
        # Another application's database, or a weft_sync file under another ?table=: creating
        # a table in it is rarely the fix.
        return "; the file exists but has no such table: check the path and ?table= in the URL"
    return f"; '{store.command('doctor --fix')}' creates it"


def _check_store(storage: Storage, fix: bool, report: Report, store: StoreRef) -> None:
    caps = storage.capabilities
    report(
        "ok" if caps.conditional_batch else "FAIL",
        f"declares compare-and-swap (multi_process={caps.multi_process}, "
        f"multi_host={caps.multi_host})",
    )
    if fix:
        probe = f"weft-doctor:{uuid.uuid4().hex}"
        first = storage.conditional_batch([Condition(probe, None)], [Put(probe, encode_epoch(1))])
        second = storage.conditional_batch([Condition(probe, None)], [Put(probe, encode_epoch(2))])
        storage.conditional_batch([], [Delete(probe)])
        report("ok" if first and not second else "FAIL", "compare-and-swap refuses a stale write")
    else:
        fix_command = store.command("doctor --fix")
        report("info", f"compare-and-swap probe skipped: it writes; '{fix_command}' runs it")
    raw = read_value(storage, keys.OWNERSHIP_MODE_MARKER)
    marker = decode_mode_marker(raw) if isinstance(raw, bytes) else None
    if raw is None:
        report("ok", "mode marker: absent (the first engine stamps it)")
    elif isinstance(raw, Unreadable):
        report("FAIL", f"mode marker: {raw.reason}; an operator must repair it")
    elif marker is None:
        report("FAIL", "mode marker: present but corrupt; an operator must repair it")
    else:
        report("ok" if marker.mode == "workflow-lease" else "FAIL", f"mode marker: {marker.mode!r}")
    view = read_store_view(storage)
    total = sum(view.live.values()) + sum(view.expired.values())
    rows = [] if total == 0 else _far_future(storage, view.now)
    report(
        "FAIL" if rows else "ok",
        f"clock sanity: {len(rows)} of {total} claims expire more than a day ahead",
    )
    report(
        "FAIL" if view.undecodable else "ok",
        f"holder records: {view.undecodable} do not decode",
    )
    _check_epochs(storage, report, store)
    report("info", f"expired claims awaiting takeover: {sum(view.expired.values())}")
    report("info", f"running workflows without a holder: {len(view.running_without_holder)}")
    _report_replication(storage, report)


def _report_replication(storage: Storage, report: Report) -> None:
    """How the server replicates commits (PostgreSQL only), and what that means for fencing.

    A standby takes no writes at all. On a primary whose commits wait for a synchronous
    standby, a promoted standby has every acknowledged epoch. On an asynchronous one, a
    promoted standby may lack the last epochs: it can hand an epoch number out again, which
    the epoch token (number plus random mint id) keeps from matching the deposed owner's, so
    that owner's writes fail closed, but the work acknowledged in those last commits is gone.
    """
    settings_of = getattr(storage, "replication_settings", None)
    if not callable(settings_of):
        return
    settings = settings_of()
    detail = (
        f"synchronous_commit={settings.synchronous_commit}, "
        f"synchronous_standby_names={settings.synchronous_standby_names!r}, "
        f"{settings.standbys} standby(s) streaming"
        + (
            ""
            if settings.sync_standbys is None
            else f", {settings.sync_standbys} of them synchronous"
        )
    )
    report(*_replication_verdict(settings, detail))


def _replication_verdict(settings: ReplicationSettings, detail: str) -> tuple[str, str]:
    if settings.is_standby:
        return (
            "FAIL",
            f"replication: this server is a standby ({detail}): it takes no writes, so engines "
            f"cannot claim or renew here; point them at the primary",
        )
    if settings.failover_safe and settings.sync_standbys != 0:
        return (
            "ok",
            f"replication: primary with synchronous standbys ({detail}): an acknowledged epoch "
            f"is on a standby too, so a failover to it loses none; fences stay exact",
        )
    if settings.failover_safe:
        return (
            "info",
            f"replication: primary configured for synchronous standbys but none is streaming "
            f"now ({detail}): commits wait for one to connect",
        )
    if settings.standbys:
        return (
            "info",
            f"replication: primary with asynchronous standbys only ({detail}): a failover may "
            f"lose the last acknowledged epochs; the new primary can mint an epoch number "
            f"again, but never the same token, so the deposed owner's writes fail closed (the "
            f"work in the lost commits is gone; configure synchronous_standby_names to keep it)",
        )
    return (
        "info",
        f"replication: no standby streaming ({detail}): nothing to fail over to; a restore "
        f"from backup is the only way back, and the epoch token fences it the same way",
    )


def _far_future(storage: Storage, now: int) -> list[str]:
    return [
        row.workflow_id
        for row in read_claims(storage)
        if row.holder is not None and row.holder.expires_at - now > CLOCK_SKEW_LIMIT_MS
    ]


def _check_epochs(storage: Storage, report: Report, store: StoreRef) -> None:
    # A corrupt epoch fails closed (nothing can acquire the workflow), and only an operator can
    # say which epoch is safely above every one handed out: name each key and the repair.
    corrupt = _corrupt_epochs(storage, CORRUPT_EPOCHS_SHOWN + 1)
    if not corrupt:
        report("ok", "epoch keys: every one decodes")
        return
    more = "+" if len(corrupt) > CORRUPT_EPOCHS_SHOWN else ""
    report("FAIL", f"epoch keys: {min(len(corrupt), CORRUPT_EPOCHS_SHOWN)}{more} do not decode")
    for key, workflow_id, value in corrupt[:CORRUPT_EPOCHS_SHOWN]:
        if isinstance(value, Unreadable):
            report("FAIL", f"  {key!r}: {value.reason}; refused, and not replaced by repair-epoch")
        elif workflow_id is None:
            report("FAIL", f"  {key!r} ({len(value)} bytes): the key itself does not decode")
        else:
            report(
                "FAIL",
                f"  {key!r} ({len(value)} bytes): refused until repaired with "
                f"'{store.command('repair-epoch ' + workflow_id)}'",
            )


def _corrupt_epochs(storage: Storage, limit: int) -> list[tuple[str, str | None, Value]]:
    """The first ``limit`` epoch keys whose value does not decode: key, workflow id, value."""
    prefix = keys.workflow_owner_epoch("")
    found: list[tuple[str, str | None, Value]] = []
    for key, value in scan_rows(storage, prefix):
        if isinstance(value, Unreadable) or decode_epoch(value) is None:
            found.append((key, keys.try_decode_key_component(key[len(prefix) :]), value))
            if len(found) >= limit:
                break
    return found
