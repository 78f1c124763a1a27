"""Commands that change the store: ``cancel``, ``release`` and ``repair-epoch`` (from outside),
and ``demo``."""

from __future__ import annotations

from typing import Final, TextIO

from ... import keys
from ...claims.engine_index import release_entry_ops
from ...claims.epochs import repair_corrupt_epoch
from ...claims.transitions import build_external_rotation_transition, extract_put_value
from ...clock import system_clock
from ...codec import EPOCH_MAX, decode_epoch, decode_holder, try_decode_workflow_record
from ...storage import Condition, storage_conditional_batch
from ...workflows import WorkflowNotFoundError, Workflows
from .output import CommandError, NotFound, StoreRef, UsageError, human_time

RELEASE_ATTEMPTS: Final = 5
"""Compare-and-swap attempts of ``release`` while the claim keeps changing under it."""

# A record in one of these statuses is driven by its holder: ``cancel`` stops it, not ``release``.
_DRIVEN_STATUSES: Final = frozenset({"pending", "running", "suspended"})


def cancel(store: StoreRef, workflow_id: str, out: TextIO) -> int:
    """Cancel a workflow from outside; its owner (if any) is deposed."""
    wid = keys.validate_workflow_id(workflow_id)
    with store.open(read_only=False) as storage:
        try:
            record = Workflows(storage).cancel(wid)
        except WorkflowNotFoundError:
            raise NotFound(f"no workflow {wid!r} in the store") from None
        epoch = decode_epoch(storage.get(keys.workflow_owner_epoch(wid)))
    out.write(f"{record.workflow_id}: {record.status} (epoch now {epoch})\n")
    return 0


def release(store: StoreRef, workflow_id: str, out: TextIO) -> int:
    """Clear a bare claim from outside: delete its holder and rotate its epoch.

    The holder is deposed exactly as ``cancel`` deposes a workflow's owner: its next fenced
    write and its next renewal fail. A workflow record that is still driven is refused (use
    ``cancel``), so no running workflow loses its owner without a state change saying so.
    """
    wid = keys.validate_workflow_id(workflow_id)
    with store.open(read_only=False) as storage:
        for _ in range(RELEASE_ATTEMPTS):
            record_raw = storage.get(keys.workflow(wid))
            if record_raw is not None:
                record = try_decode_workflow_record(record_raw)
                status = "undecodable" if record is None else record.status
                if record is None or status in _DRIVEN_STATUSES:
                    raise CommandError(
                        f"{wid!r} is a {status} workflow, not a bare claim; use "
                        f"'{store.command('cancel ' + wid)}' to stop it and depose its owner"
                    )
            holder_key = keys.workflow_owner_holder(wid)
            holder_raw = storage.get(holder_key)
            if holder_raw is None:
                raise NotFound(f"no claim on {wid!r} to release")
            epoch_key = keys.workflow_owner_epoch(wid)
            rotation = build_external_rotation_transition(
                workflow_id=wid, observed_epoch_bytes=storage.get(epoch_key)
            )
            conditions = [
                Condition(keys.workflow(wid), record_raw),
                Condition(holder_key, holder_raw),
                *rotation.conditions,
            ]
            operations = [*rotation.operations, *release_entry_ops(wid, holder_raw)]
            if storage_conditional_batch(storage, conditions, operations):
                epoch = decode_epoch(extract_put_value(rotation.operations, epoch_key))
                out.write(f"{wid}: released ({_holder_text(holder_raw)}; epoch now {epoch})\n")
                return 0
    raise CommandError(
        f"the claim on {wid!r} kept changing during {RELEASE_ATTEMPTS} attempts; nothing was "
        f"released: run the command again"
    )


def repair_epoch(store: StoreRef, workflow_id: str, at_least: int | None, out: TextIO) -> int:
    """Replace a corrupt epoch key with one above any handed out; its holder is deposed.

    The new epoch is derived from the clock (milliseconds x 1000), or ``--at-least`` when the
    operator knows a higher bound (for example after restoring a backup of an older store).
    """
    wid = keys.validate_workflow_id(workflow_id)
    # Checked here, not by repair_corrupt_epoch: its ValueError also means "nothing to repair".
    if at_least is not None and not 1 <= at_least < EPOCH_MAX:
        raise UsageError(f"--at-least must be from 1 to {EPOCH_MAX - 1}, got {at_least}")
    with store.open(read_only=False) as storage:
        try:
            epoch = repair_corrupt_epoch(storage, wid, at_least=at_least)
        except ValueError as exc:
            if storage.get(keys.workflow_owner_epoch(wid)) is None:
                raise NotFound(str(exc)) from None
            raise CommandError(str(exc)) from None
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    out.write(f"{wid}: epoch repaired, now {epoch}; its former holder is deposed\n")
    return 0


def _holder_text(holder_raw: bytes) -> str:
    holder = decode_holder(holder_raw)
    if holder is None:
        return "its holder record did not decode"
    now = system_clock()
    state = "a live claim, now deposed" if holder.expires_at >= now else "expired"
    return f"held by {holder.engine_id}, {state}, expiry {human_time(holder.expires_at, now)}"


def demo(
    workers: int, workflow_count: int, keep: str | None, out: TextIO, *, url_given: bool = False
) -> int:
    """Run the multi-process takeover demonstration.

    :param url_given: ``--url`` was on the command line: refused, since the demo creates,
        fills and deletes a store of its own and must never write into one of yours.
    :raises UsageError: ``url_given``, or too few workers or workflows.
    """
    from ...demo import DemoSettings, run_demo

    if url_given:
        raise UsageError(
            "demo does not take --url: it runs on a temporary SQLite store of its own (and "
            "never writes into yours); use 'demo --keep DIR' to keep that store for inspection"
        )
    if workers < 2 or workflow_count < 1:
        raise UsageError(
            f"demo needs --workers >= 2 and --workflows >= 1, got {workers}, {workflow_count}"
        )

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    settings = DemoSettings(workers=workers, workflows=workflow_count)
    return run_demo(say, settings, keep_dir=keep)
