"""The crash fast path as an engine wires it: watcher -> ``request_reclaim`` -> takeover -> drive.

The survivor runs real background maintenance with a renew interval far longer than the test,
so its first tick never comes: the claims of the SIGKILLed process can only move through the
crash probe asking for an immediate reclaim pass. (How fast is measured by
``bench/takeover_latency.py``, never asserted here.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from tests.claims.gated import WarningSink
from tests.liveness.procs import POLL_S, WAIT_S, holding
from tests.maintenance.discovery_helpers import JOB, Driven, holders
from tests.maintenance.helpers import write_workflow
from tests.support.waiting import wait_until
from weft_sync import Ownership, OwnershipOptions
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import system_clock
from weft_sync.storage import Storage

# The first maintenance tick comes after one renew interval: far beyond the waits here.
OPTIONS = OwnershipOptions(claim_ttl="900s", claim_renew_interval="300s")


class _RaisingHandler(logging.Handler):
    """A host's log handler whose ``emit`` raises on every INFO line, as a broken one may."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO:
            raise RuntimeError("the host's log handler failed")


@contextlib.contextmanager
def _broken_info_logging(broken: bool) -> Iterator[None]:
    """With ``broken``, every INFO line of the crash path raises in the caller's thread."""
    if not broken:
        yield
        return
    handler = _RaisingHandler(logging.INFO)
    loggers = [
        logging.getLogger(f"weft_sync.reclaim.{name}") for name in ("crash_detection", "watcher")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


@pytest.mark.parametrize("broken_logging", [False, True], ids=["logging", "raising-log-handler"])
def test_a_killed_engines_claims_move_through_the_crash_probe(
    storage: Storage, storage_url: str, broken_logging: bool
) -> None:
    ids = [f"crash-{n}" for n in range(5)]
    with holding(storage_url, "engine-k", "engine") as child, _broken_info_logging(broken_logging):
        registry = ClaimRegistry(
            storage,
            engine_id="engine-k",
            clock=system_clock,
            claim_ttl_ms=900_000,
            claim_renew_interval_ms=300_000,
            warn=WarningSink(),
        )
        for wid in ids:
            write_workflow(storage, wid, wf_type=JOB)
            assert registry.acquire(wid).status == "acquired"
        driven = Driven()
        with Ownership.open(
            storage, engine_id="engine-s", options=OPTIONS, handlers={JOB: driven}
        ) as survivor:
            assert survivor.started
            child.proc.kill()
            child.proc.wait()

            wait_until(
                lambda: driven.all_ids() == ids,
                "the survivor drove every claim",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )

            assert holders(storage, ids) == dict.fromkeys(ids, ("engine-s", 2))
        registry.close()
