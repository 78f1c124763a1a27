"""The liveness watcher against real engines in subprocesses: SIGKILL is reported, SIGSTOP not."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from tests.liveness.procs import POLL_S, WAIT_S, holding
from tests.liveness.wrappers import ProbeCounting, WithoutSessionLocks
from tests.support.waiting import wait_until
from weft_sync.clock import system_clock
from weft_sync.reclaim.watcher import THREAD_NAME, LivenessWatcher
from weft_sync.storage import Storage
from weft_sync.storage.session_locks import SessionLock, storage_session_locks


class DeadLog:
    """Collects on_dead calls; optionally raises from the first."""

    def __init__(self, *, raise_first: bool = False) -> None:
        self.calls: list[str] = []
        self.called = threading.Event()
        self._raise = raise_first

    def __call__(self, engine_id: str) -> None:
        self.calls.append(engine_id)
        self.called.set()
        if self._raise:
            self._raise = False
            raise RuntimeError("on_dead failed")


def _watcher(storage: object, dead: DeadLog) -> LivenessWatcher:
    return LivenessWatcher(
        storage,  # type: ignore[arg-type]
        engine_id="me",
        on_dead=dead,
        poll_ms=10,
        refresh_ms=100,
        clock=system_clock,
    )


def test_sigkill_of_an_engine_is_reported_once(storage: Storage, storage_url: str) -> None:
    wrapper = ProbeCounting(storage)
    dead = DeadLog()
    watcher = _watcher(wrapper, dead)
    with holding(storage_url, "victim", mode="engine") as victim:
        assert watcher.start() is True
        try:
            assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == 1
            wait_until(
                lambda: watcher.watched() == {"victim"},
                "the victim is watched",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            victim.signal(signal.SIGKILL)
            victim.proc.wait()
            assert dead.called.wait(30), "on_dead was not called after SIGKILL"
            wrapper.wait_for_probes(10)  # several more surveys: still reported once only
            assert dead.calls == ["victim"]
            assert watcher.watched() == frozenset()
        finally:
            watcher.close()
    assert not watcher.running


def test_sigstop_of_an_engine_is_not_reported(storage: Storage, storage_url: str) -> None:
    wrapper = ProbeCounting(storage)
    dead = DeadLog()
    watcher = _watcher(wrapper, dead)
    with holding(storage_url, "frozen", mode="engine") as frozen:
        watcher.start()
        try:
            wait_until(
                lambda: watcher.watched() == {"frozen"},
                "the engine is watched",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            frozen.signal(signal.SIGSTOP)
            wrapper.wait_for_probes(30)
            assert dead.calls == []
            assert watcher.watched() == {"frozen"}
            frozen.signal(signal.SIGCONT)
        finally:
            watcher.close()


def test_storage_errors_and_a_failing_callback_never_stop_the_watcher(
    storage: Storage, storage_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    wrapper = ProbeCounting(storage)
    dead = DeadLog(raise_first=True)
    watcher = _watcher(wrapper, dead)
    with (
        caplog.at_level(logging.WARNING, logger="weft_sync.reclaim.watcher"),
        holding(storage_url, "one", mode="engine") as one,
        holding(storage_url, "two", mode="engine") as two,
    ):
        watcher.start()
        try:
            wait_until(
                lambda: watcher.watched() == {"one", "two"},
                "both engines are watched",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            wrapper.fail_probes = 5
            wrapper.wait_for_probes(10)
            assert "storage error" in caplog.text
            one.signal(signal.SIGKILL)
            one.proc.wait()
            wait_until(
                lambda: dead.calls == ["one"],
                "the first engine is reported",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            wait_until(
                lambda: "on_dead('one') of the liveness watcher failed" in caplog.text,
                "the failing callback is logged",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            two.signal(signal.SIGKILL)
            two.proc.wait()
            wait_until(
                lambda: dead.calls == ["one", "two"],
                "the second engine is reported",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            assert watcher.running
        finally:
            watcher.close()


def test_a_store_without_session_locks_starts_no_thread(storage: Storage) -> None:
    watcher = _watcher(WithoutSessionLocks(storage), DeadLog())
    assert watcher.start() is False
    assert not watcher.running
    watcher.close()


def test_close_is_idempotent_and_start_after_close_is_refused(storage: Storage) -> None:
    watcher = _watcher(storage, DeadLog())
    watcher.start()
    watcher.close()
    watcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        watcher.start()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poll_ms": 0}, "poll_ms"),
        ({"poll_ms": True}, "poll_ms"),
        ({"refresh_ms": -5}, "refresh_ms"),
        ({"refresh_ms": 1.5}, "refresh_ms"),
    ],
)
def test_bad_intervals_are_refused_naming_them(
    storage: Storage, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LivenessWatcher(
            storage,
            engine_id="me",
            on_dead=DeadLog(),
            clock=system_clock,
            **kwargs,  # type: ignore[arg-type]
        )


def test_a_watcher_whose_own_lock_is_gone_reports_nothing(
    storage: Storage, storage_url: str
) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    own = locks.acquire_session_lock("me")
    own.release()  # gone for good: ensure() cannot bring a released lock back
    wrapper = ProbeCounting(storage)
    dead = DeadLog()
    watcher = LivenessWatcher(
        wrapper,  # type: ignore[arg-type]
        engine_id="me",
        on_dead=dead,
        poll_ms=10,
        refresh_ms=100,
        clock=system_clock,
        own_lock=own,
    )
    with holding(storage_url, "peer", mode="engine") as peer:
        watcher.start()
        try:
            # The first survey already distrusts every lock, so the peer is never watched.
            wrapper.wait_for_probes(3)
            assert watcher.watched() == frozenset()
            peer.signal(signal.SIGKILL)
            peer.proc.wait()
            wait_until(
                lambda: not locks.held_session_locks(["peer"]),
                "the peer's lock is gone",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            wrapper.wait_for_probes(5)
            assert dead.calls == []
        finally:
            watcher.close()


def test_a_watcher_takes_its_own_lost_lock_again_and_keeps_reporting(
    storage: Storage, storage_url: str
) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    own = locks.acquire_session_lock("me")
    dead = DeadLog()
    watcher = LivenessWatcher(
        storage,
        engine_id="me",
        on_dead=dead,
        poll_ms=10,
        refresh_ms=100,
        clock=system_clock,
        own_lock=own,
    )
    try:
        with holding(storage_url, "peer", mode="engine") as peer:
            watcher.start()
            wait_until(
                lambda: watcher.watched() == {"peer"},
                "the peer is watched",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            _lose(storage, own)
            wait_until(
                lambda: locks.held_session_locks(["me"]) == {"me"},
                "own lock re-taken",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            assert watcher.watched() == {"peer"}
            peer.signal(signal.SIGKILL)
            peer.proc.wait()
            assert dead.called.wait(30)
            assert dead.calls == ["peer"]
    finally:
        watcher.close()
        own.release()


def _lose(storage: Storage, lock: SessionLock) -> None:
    """Make ``lock`` lost the way each backend can lose it: file removed, session terminated."""
    if lock.token.startswith("flock:"):
        os.unlink(lock.token.removeprefix("flock:"))
        return
    backend_pid = int(lock.identity.split(":")[0])  # the lock session's backend
    with storage._connection("test") as conn:  # type: ignore[attr-defined]
        conn.execute("SELECT pg_terminate_backend(%s)", [backend_pid])


def test_the_watcher_stops_when_its_store_is_closed(open_store: object) -> None:
    store = open_store()  # type: ignore[operator]
    watcher = _watcher(store, DeadLog())
    watcher.start()
    store.close()
    wait_until(
        lambda: not watcher.running, "the watcher thread ends", timeout_s=WAIT_S, poll_s=POLL_S
    )
    watcher.close()
