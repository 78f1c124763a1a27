"""The liveness watcher survives a ``BaseException`` from what it calls, and logs it.

Host code runs on the watcher thread: ``on_dead`` and, behind a custom store, the probes. A
``SystemExit`` (or the like) from either must not end the thread, which would leave every
later crash undetected and say nothing (``threading`` drops a thread's ``SystemExit`` silently).
The crashed engines are records naming lock objects a dead holder left (:mod:`.crashes`), in
this process, on both backends.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest

from tests.liveness.crashes import dead_lock
from tests.liveness.wrappers import ProbeCounting
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.watcher import LivenessWatcher
from weft_sync.storage import Storage

_RECORD = EngineRecord("e", "live", 10_000, 3_000, 1_000, 2, "e", 1, "h", 0)


class HostExit(SystemExit):
    """What host code raises (a subclass, so that nothing else is mistaken for it)."""


class Deaths:
    """An ``on_dead`` recording each call; the first raises :class:`HostExit`."""

    def __init__(self) -> None:
        # _lock guards calls and _raised.
        self._lock = threading.Lock()
        self.calls: list[str] = []
        self._raised = False

    def __call__(self, engine_id: str) -> None:
        with self._lock:
            self.calls.append(engine_id)
            first, self._raised = not self._raised, True
        if first:
            raise HostExit(3)

    def reported(self) -> list[str]:
        with self._lock:
            return sorted(self.calls)


def _crashed(storage: Storage, engine_id: str) -> None:
    identity = dead_lock(storage, engine_id)
    record = replace(_RECORD, engine_id=engine_id, lock=engine_id, lock_id=identity)
    storage.put(keys.engine_liveness(engine_id), encode_engine_record(record))


def _watcher(storage: object, on_dead: Deaths) -> LivenessWatcher:
    return LivenessWatcher(
        storage,  # type: ignore[arg-type]
        engine_id="me",
        on_dead=on_dead,
        poll_ms=10,
        refresh_ms=50,
        clock=ManualClock(10_000),
    )


def test_an_on_dead_that_raises_system_exit_is_logged_and_the_others_are_reported(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    _crashed(storage, "one")
    _crashed(storage, "two")
    deaths = Deaths()
    watcher = _watcher(storage, deaths)
    with caplog.at_level(logging.ERROR, logger="weft_sync.reclaim.watcher"):
        assert watcher.start() is True
        try:
            wait_until(lambda: deaths.reported() == ["one", "two"], "both engines reported")
            assert watcher.running
            assert "of the liveness watcher failed" in caplog.text
            _crashed(storage, "three")
            wait_until(
                lambda: deaths.reported() == ["one", "three", "two"], "a later crash reported"
            )
            assert watcher.running
        finally:
            watcher.close()
    assert not watcher.running


def test_a_probe_that_raises_system_exit_is_logged_and_the_watching_goes_on(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    wrapper = ProbeCounting(storage)
    wrapper.probe_error = HostExit(3)
    wrapper.fail_probes = 1
    _crashed(storage, "one")
    deaths = Deaths()
    watcher = _watcher(wrapper, deaths)
    with caplog.at_level(logging.ERROR, logger="weft_sync.reclaim.watcher"):
        watcher.start()
        try:
            wait_until(lambda: deaths.reported() == ["one"], "the crash reported")
            assert "failed a step" in caplog.text
            assert watcher.running
        finally:
            watcher.close()


class _RaisingHandler(logging.Handler):
    """A host's log handler whose ``emit`` raises (no ``handleError``), as a broken one may."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO and "reported dead" in record.getMessage():
            raise RuntimeError("the host's log handler failed")


class _Calls:
    """An ``on_dead`` that only records."""

    def __init__(self) -> None:
        # _lock guards calls.
        self._lock = threading.Lock()
        self.calls: list[str] = []

    def __call__(self, engine_id: str) -> None:
        with self._lock:
            self.calls.append(engine_id)

    def reported(self) -> list[str]:
        with self._lock:
            return sorted(self.calls)


def test_a_log_handler_that_raises_costs_no_report(storage: Storage) -> None:
    _crashed(storage, "one")
    _crashed(storage, "two")
    calls = _Calls()
    logger = logging.getLogger("weft_sync.reclaim.watcher")
    handler = _RaisingHandler(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    watcher = _watcher(storage, calls)  # type: ignore[arg-type]
    try:
        watcher.start()
        try:
            # Both engines are found in one survey; each report comes before its log line.
            wait_until(lambda: calls.reported() == ["one", "two"], "both engines reported")
            assert watcher.running
        finally:
            watcher.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
