"""``python manage.py weft_maintain``: weft_sync maintenance for a Django deployment.

Renews this process's claims, reclaims workflows whose process died, and resumes them with the
handler ``settings.WEFT_SYNC_HANDLERS`` names for their type. ``--once`` runs one pass (for cron
or a Kubernetes CronJob); ``--interval`` runs a pass every renew interval until SIGTERM or
Ctrl-C (``--passes N`` stops after N passes). Exits 1 when reclaim discovery fails.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string

from reports.handlers import seed_abandoned_report
from weft_sync import Ownership, OwnershipOptions
from weft_sync.codec import WorkflowRecord
from weft_sync.maintenance import PassResult
from weft_sync.workflows import Workflows

Handler = Callable[[Workflows, WorkflowRecord], object]


class Command(BaseCommand):
    help = "Run weft_sync maintenance: renew claims, reclaim abandoned workflows, resume them."
    # Nothing here depends on models, URLs or templates: skip Django's system checks.
    requires_system_checks = ()

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", help="store URL (default: settings.WEFT_SYNC_URL)")
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--once", action="store_true", help="one pass, then exit (default)")
        mode.add_argument("--interval", action="store_true", help="a pass every renew interval")
        parser.add_argument(
            "--passes", type=int, default=0, help="with --interval: stop after N passes"
        )
        parser.add_argument("--claim-ttl", default="30s", help="claim TTL (default 30s)")
        parser.add_argument("--renew-interval", default="5s", help="renew interval (default 5s)")
        parser.add_argument(
            "--demo", action="store_true", help="first leave an abandoned report in the store"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        handlers: dict[str, Handler] = {
            workflow_type: import_string(path)
            for workflow_type, path in settings.WEFT_SYNC_HANDLERS.items()
        }
        try:
            options = OwnershipOptions(
                claim_ttl=opts["claim_ttl"], claim_renew_interval=opts["renew_interval"]
            )
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from None
        with tempfile.TemporaryDirectory(prefix="weft-django-") as tmp:
            url = opts["url"] or settings.WEFT_SYNC_URL or f"sqlite:///{Path(tmp) / 'weft.db'}"
            if opts["demo"]:
                seed_abandoned_report(url)
            self._maintain(url, options, handlers, opts)

    def _maintain(
        self,
        url: str,
        options: OwnershipOptions,
        handlers: dict[str, Handler],
        opts: dict[str, Any],
    ) -> None:
        ownership: Ownership

        def resume(workflow_id: str) -> None:
            # Runs inside the pass, on a maintenance worker thread, once the claim is ours.
            record = ownership.workflows.get(workflow_id)
            if record is not None:
                handlers[record.type](ownership.workflows, record)

        # Signals only set ``stop`` from before the store is opened until after it is closed:
        # a SIGTERM at any moment lets the pass in flight finish and the claims be released.
        with (
            _stop_on_signals() as stop,
            Ownership.open(
                url,
                options=options,
                on_reclaimed=resume,
                is_eligible=lambda workflow_type, revision: workflow_type in handlers,
                background="manual",
            ) as ownership,
        ):
            if not opts["interval"]:
                self._report(1, ownership, ownership.run_maintenance())
                return
            passes = 0
            while not stop.is_set():
                passes += 1
                self._report(passes, ownership, ownership.run_maintenance())
                if passes == opts["passes"]:
                    break
                stop.wait(options.claim_renew_interval_ms / 1000)
            self.stdout.write(f"stopping after {passes} passes; releasing claims")

    def _report(self, number: int, ownership: Ownership, result: PassResult) -> None:
        reclaim = result.reclaim
        if reclaim is None or reclaim.status == "discovery-failed":
            raise CommandError(
                f"pass {number}: reclaim discovery failed: {reclaim and reclaim.error}"
            )
        self.stdout.write(
            f"pass {number}: renewed {result.renewed_count}, reclaimed "
            f"{reclaim.reclaimed_count} of {len(reclaim.outcomes)} candidates"
        )
        for outcome in reclaim.outcomes:
            if outcome.status == "reclaimed":
                finished = ownership.workflows.get_outcome(outcome.workflow_id)
                state = "still running" if finished is None else finished.status
                self.stdout.write(f"  resumed {outcome.workflow_id}: {state}")
            elif outcome.status == "error":
                self.stderr.write(f"  {outcome.workflow_id}: resume failed: {outcome.error!r}")


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT while the block runs; the old handlers come back after."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
