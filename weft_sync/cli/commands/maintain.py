"""``maintain``: run maintenance passes once (cron) or on an interval, driving reclaimed work."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Final, TextIO

from ...maintenance import PassResult
from ...maintenance.targets import ReclaimOutcome, ReclaimOutcomeStatus
from ...options import OwnershipOptions, parse_duration
from ...ownership.facade import Ownership, WorkflowHandler
from ...redaction import redact_text
from ...storage import Storage
from .logs import warnings_to_stderr
from .output import StoreRef, UsageError, emit_json

StopSignals = Callable[[], AbstractContextManager[threading.Event]]
"""Returns a context manager yielding an event set on SIGTERM or SIGINT while it is open."""

_SHOWN_ERRORS: Final = 5
"""Failed candidates whose error is printed in the text summary (all are counted)."""


def load_handler(spec: str) -> WorkflowHandler:
    """Import ``MODULE:FUNCTION`` and return the callable.

    :raises UsageError: the spec is malformed, cannot be imported, or is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--handler must be MODULE:FUNCTION, got {spec!r}")
    # The ``weft-sync`` script's sys.path starts with the script's own directory, where
    # ``python -m weft_sync`` puts the working directory: import from it the same way, so both
    # find ``examples.jobs`` or ``myapp.handlers`` next to where the operator runs them.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # the module's own import-time failure is the operator's to fix
        raise UsageError(f"cannot load --handler {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(handler):
        raise UsageError(f"--handler {spec!r} is not callable")
    return handler  # type: ignore[no-any-return]


class _EveryType:
    """An eligibility predicate that gives every workflow type the ``--handler`` function.

    Without ``--type`` the handler drives every type, but handlers are registered per type: the
    first time the reclaim pass asks about a type, the function is registered for it, so the
    handler table calls it with a ``ReclaimedWorkflow`` like any handler registered up front.
    """

    def __init__(self, handler: WorkflowHandler) -> None:
        self._handler = handler
        self.ownership: Ownership | None = None

    def __call__(self, workflow_type: str, revision: str | None) -> bool:
        ownership = self.ownership
        if ownership is None:
            return False
        if ownership.handlers.get(workflow_type) is None:
            # Two maintenance threads may meet a new type at once: the loser's register fails
            # because the same function is already registered, which is what it wanted.
            with contextlib.suppress(ValueError):
                ownership.handlers.register(workflow_type, self._handler)
        return ownership.handlers.get(workflow_type) is not None


def _duration(option: str, value: str) -> int:
    """``value`` of ``option`` in milliseconds.

    :raises UsageError: not a duration (the message names the option and the value).
    """
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _open_engine(
    storage: Storage,
    options: OwnershipOptions,
    handler: WorkflowHandler | None,
    types: list[str],
    given: Mapping[str, WorkflowHandler] | None = None,
) -> Ownership:
    """An engine (not started) that drives, through ``handler``, the types it names.

    ``given`` are the handlers of an integration (Flask, Django) for their own types; the
    ``--handler`` function overrides them for the types it names. With no handler at all the
    engine has no handler, ``is_eligible`` or ``on_reclaimed``, so it reclaims no workflow
    record: it only renews, and takes over nothing it could not drive.
    """
    handlers = dict(given or {})
    if handler is None or types:
        handlers.update({t: handler for t in types} if handler is not None else {})
        return Ownership.open(
            storage, options=options, handlers=handlers or None, background="manual"
        )
    every_type = _EveryType(handler)
    ownership = Ownership.open(
        storage,
        options=options,
        handlers=handlers or None,
        is_eligible=every_type,
        background="manual",
    )
    every_type.ownership = ownership
    return ownership


def maintain(
    store: StoreRef,
    args: argparse.Namespace,
    out: TextIO,
    stops: StopSignals,
    handlers: Mapping[str, WorkflowHandler] | None = None,
) -> int:
    """Run maintenance once (``--once``) or until SIGTERM / Ctrl-C (``--interval``).

    ``--once`` exits 1 when the pass failed (discovery, or a renewal) or any candidate errored.

    :param handlers: an integration's handlers by workflow type (see :func:`_open_engine`).
    """
    options = OwnershipOptions(
        claim_ttl=_duration("--claim-ttl", args.claim_ttl),
        claim_renew_interval=_duration("--renew-interval", args.renew_interval),
    )
    if args.types and not args.handler:
        raise UsageError("--type names the workflow types --handler drives; give --handler too")
    handler = load_handler(args.handler) if args.handler else None
    # The library's warnings and errors (a handler that raised, a lost claim) go to stderr one
    # line each from before the engine opens until after it closed, never as a traceback.
    with warnings_to_stderr(), store.open(read_only=False) as storage:
        if args.once:
            with _open_engine(storage, options, handler, args.types, handlers) as ownership:
                result = ownership.run_maintenance()  # waits for the handlers it started
                raised = ownership.handlers.take_failures()
            return _report_once(result, args.json, handler is None and not handlers, out, raised)
        # The handlers go in before the engine starts and come out after it closed, so a signal
        # at any moment ends in a clean close, never in the default handler's abrupt exit.
        with (
            stops() as stop,
            _open_engine(storage, options, handler, args.types, handlers) as ownership,
        ):
            ownership.start()
            out.write(
                f"maintaining {store.shown} as engine {ownership.engine_id}; "
                f"Ctrl-C or SIGTERM stops\n"
            )
            out.flush()
            stop.wait()
            out.write("stopping: releasing claims\n")
            out.flush()
    return 0


def _with_handler_errors(
    outcomes: Sequence[ReclaimOutcome], raised: Mapping[str, Exception]
) -> tuple[ReclaimOutcome, ...]:
    """The pass's outcomes, a reclaimed workflow whose handler raised shown as an error: the
    handler runs on a handler thread after the pass, which reported the takeover itself."""
    return tuple(
        dataclasses.replace(o, status=ReclaimOutcomeStatus.ERROR, error=raised[o.workflow_id])
        if o.status == ReclaimOutcomeStatus.RECLAIMED and o.workflow_id in raised
        else o
        for o in outcomes
    )


def _report_once(
    result: PassResult,
    as_json: bool,
    no_handler: bool,
    out: TextIO,
    raised: Mapping[str, Exception] | None = None,
) -> int:
    reclaim = result.reclaim
    outcomes = _with_handler_errors(reclaim.outcomes if reclaim is not None else (), raised or {})
    counts = Counter(str(o.status.value) for o in outcomes)
    errors = [o for o in outcomes if o.status == ReclaimOutcomeStatus.ERROR]
    discovery_error = None
    if reclaim is not None and reclaim.status == "discovery-failed":
        discovery_error = redact_text(str(reclaim.error))
    failed = bool(errors) or result.failed_count > 0 or discovery_error is not None
    summary = {
        "renewed": result.renewed_count,
        "failed": result.failed_count,
        "reclaim_status": str(reclaim.status.value) if reclaim else None,
        "candidates": len(outcomes),
        "reclaimed": counts[ReclaimOutcomeStatus.RECLAIMED.value],
        "outcomes": {s.value: counts[s.value] for s in ReclaimOutcomeStatus},
        "errors": {o.workflow_id: redact_text(str(o.error)) for o in errors},
        "discovery_error": discovery_error,
        "ok": not failed,
    }
    if as_json:
        emit_json(summary, out)
        return 1 if failed else 0
    out.write(
        f"renewed {summary['renewed']}, failed {summary['failed']}; "
        f"{len(outcomes)} reclaim candidates: "
        + ", ".join(f"{s.value} {counts[s.value]}" for s in ReclaimOutcomeStatus)
        + "\n"
    )
    if no_handler and outcomes:
        out.write("no --handler given, so no workflow was taken over\n")
    for outcome in errors[:_SHOWN_ERRORS]:
        out.write(f"error on {outcome.workflow_id}: {redact_text(str(outcome.error))}\n")
    if len(errors) > _SHOWN_ERRORS:
        out.write(f"... and {len(errors) - _SHOWN_ERRORS} more errors\n")
    if discovery_error is not None:
        out.write(f"reclaim discovery failed: {discovery_error}\n")
    if failed:
        out.write("maintenance pass FAILED\n")
    return 1 if failed else 0
