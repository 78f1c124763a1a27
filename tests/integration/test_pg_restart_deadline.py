"""A PostgreSQL restart of a few seconds against a short TTL: renewal resumes well inside it.

Every pooled session dies with the server, so the first calls after it is back need new
connections, which the pool opens in the background and retries with back-off while the server
is down. Those calls must not wait for a retry that comes seconds after the server is back, or
claims run into their local renew deadline although the TTL had time to spare.

The engine holds 20 claims with a TTL of 9 s and a renew interval of 500 ms, so its local renew
deadline is 8.5 s after the start of a claim's last successful renewal. The server is stopped
for 4 s and started again on the same socket, which leaves about 4 s before the deadline once
it is back. Every claim must be renewed again within 1.5 s of that, and none lost. The same
bound holds for 16 threads calling a store whose pool has at most 4 connections, through the
whole outage, with one or four connections kept open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from tests.maintenance.helpers import WAIT_S, PassRecorder
from tests.pgcluster import PostgresCluster
from tests.support.waiting import wait_for
from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.codec import decode_holder
from weft_sync.errors import StorageError
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import PassKind, PassResult
from weft_sync.storage import PostgresStorage

CLAIMS = 20
TTL_MS = 9_000
RENEW_MS = 500
DEADLINE_MS = TTL_MS - RENEW_MS
OUTAGE_S = 4.0
MIN_SLACK_MS = 2_000
"""What the deadline must still leave once the server is back, for the test to mean anything."""
RESUME_BOUND_S = 1.5
"""How soon after the server is back every claim must have been renewed again (and every caller
have succeeded): three renew intervals, well inside the slack the deadline leaves."""
CONCURRENT_CALLS = 16
SMALL_POOL = 4
POLL_S = 0.01
ENGINE_ID = "engine-restart-deadline"

_log = logging.getLogger(__name__)

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _outage(cluster: PostgresCluster) -> float:
    """Stop the server for :data:`OUTAGE_S` and start it again; return when it was back
    (``time.monotonic()``, once ``pg_ctl start -w`` saw it accept connections)."""
    cluster.stop(remove=False)
    time.sleep(OUTAGE_S)
    cluster.start()
    return time.monotonic()


def _first_full_renewal(
    passes: PassRecorder, warned: list[Warning], after_ms: int
) -> PassResult | None:
    """The first renewal pass started after ``after_ms`` that renewed every claim, or ``None``
    as soon as a claim was lost."""

    def found() -> PassResult | None:
        renewals = passes.of_kind(PassKind.RENEWAL)
        full = (r for r in renewals if r.started_at > after_ms and r.renewed_count == CLAIMS)
        return next(full, None)

    return wait_for(
        found,
        lambda r: r is not None or bool(warned),
        "a renewal pass that renewed every claim after the restart",
        timeout_s=DEADLINE_MS / 1000.0,
        poll_s=POLL_S,
    )


def test_renewals_resume_well_inside_the_deadline_after_a_restart(
    private_cluster: PostgresCluster, thread_crashes: list[threading.ExceptHookArgs]
) -> None:
    storage = PostgresStorage(
        private_cluster.url, table="weft_restart_deadline", renew_interval_ms=RENEW_MS
    )
    warned: list[Warning] = []
    passes = PassRecorder()
    try:
        engine = bootstrap_workflow_lease_ownership(
            storage=storage,
            clock=system_clock,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            on_pass_complete=passes,
            warn=warned.append,
            engine_id=ENGINE_ID,
        )
        assert engine.registry.renew_deadline_ms == DEADLINE_MS
        ids = [f"wf-{n:02d}" for n in range(CLAIMS)]
        for wid in ids:
            assert engine.registry.acquire(wid).status == "acquired"
        engine.renewal_task.start()
        try:
            assert _first_full_renewal(passes, warned, after_ms=system_clock()) is not None
            stopped_ms = system_clock()
            back = _outage(private_cluster)
            back_ms = system_clock()
            renewed = _first_full_renewal(passes, warned, after_ms=back_ms)
            resumed_s = time.monotonic() - back
        finally:
            closed = engine.renewal_task.close(timeout=WAIT_S)
        assert closed, "maintenance passes were still running after close()"

        last_before = max(
            r.started_at
            for r in passes.of_kind(PassKind.RENEWAL)
            if r.started_at <= stopped_ms and r.renewed_count == CLAIMS
        )
        slack_ms = last_before + DEADLINE_MS - back_ms
        resumed = "never" if renewed is None else f"{renewed.finished_at - back_ms} ms"
        timings = (
            f"server down {back_ms - stopped_ms} ms; every claim renewed again {resumed} after "
            f"it was back (seen {resumed_s:.3f} s); the deadline left {slack_ms} ms of slack then"
        )
        _log.info("restart timings: %s", timings)
        assert slack_ms >= MIN_SLACK_MS, f"the outage ran longer than planned: {timings}"
        assert warned == [], f"{len(warned)} claims lost ({timings}): {warned[:1]}"
        assert renewed is not None
        assert sorted(engine.registry.list_held_workflow_ids()) == ids
        assert renewed.finished_at - back_ms <= RESUME_BOUND_S * 1000, (
            f"renewals resumed late: {timings}"
        )
        holders = [
            decode_holder(value) for _, value in storage.scan(keys.workflow_owner_holder(""))
        ]
        assert len(holders) == CLAIMS
        for holder in holders:
            assert holder is not None
            assert (holder.engine_id, holder.epoch) == (ENGINE_ID, 1)
            assert holder.expires_at >= back_ms
        snapshot = engine.metrics.snapshot()
        assert snapshot.renewal_failures > 0, "no renewal failed while the server was down"
        assert snapshot.attempts["deposed"] == 0
        assert thread_crashes == []
        engine.registry.release_all()
    finally:
        storage.close()


class _Callers:
    """Threads that call the store in a loop, pausing briefly between calls, until stopped;
    each notes when its calls succeed and counts its ``StorageError`` failures."""

    def __init__(self, call: Callable[[], object], count: int) -> None:
        self._call = call
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards successes, failures and unexpected
        self.successes: list[list[float]] = [[] for _ in range(count)]
        self.failures = 0
        self.unexpected: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(n,), name=f"restart-caller-{n}", daemon=True)
            for n in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                self._call()
            except StorageError:
                with self._lock:
                    self.failures += 1
            except BaseException as exc:  # re-raised in the test
                with self._lock:
                    self.unexpected.append(exc)
                return
            else:
                with self._lock:
                    self.successes[index].append(time.monotonic())
            self._stop.wait(POLL_S)

    def first_successes_after(self, moment: float) -> list[float] | None:
        """Each thread's first success after ``moment`` (seconds after it), once every thread
        has one; ``None`` until then."""
        with self._lock:
            firsts = [next((t for t in ts if t > moment), None) for ts in self.successes]
        if any(t is None for t in firsts):
            return None
        return [t - moment for t in firsts if t is not None]

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in self._threads), "a caller thread hung"
        if self.unexpected:
            raise self.unexpected[0]


@pytest.mark.parametrize("min_size", [1, SMALL_POOL])
def test_callers_of_a_small_pool_get_connections_soon_after_a_restart(
    private_cluster: PostgresCluster, min_size: int
) -> None:
    storage = PostgresStorage(
        private_cluster.url,
        table="weft_restart_calls",
        renew_interval_ms=RENEW_MS,
        min_size=min_size,
        max_size=SMALL_POOL,
    )
    try:
        storage.put("k", b"v")
        # More callers than the pool has connections, calling before, during and after the
        # outage: every pooled session dies with the server, and the pool's replacements fail.
        callers = _Callers(lambda: storage.get("k"), CONCURRENT_CALLS)
        try:
            wait_for(
                lambda: callers.first_successes_after(0.0),
                lambda found: found is not None,
                "every caller to succeed before the outage",
            )
            back = _outage(private_cluster)
            took = wait_for(
                lambda: callers.first_successes_after(back),
                lambda found: found is not None,
                "every caller to succeed after the restart",
                timeout_s=DEADLINE_MS / 1000.0,
                poll_s=POLL_S,
            )
        finally:
            callers.stop()
        assert took is not None
        _log.info("calls after the restart first succeeded after %s s", [round(t, 3) for t in took])
        assert callers.failures > 0, "no call failed while the server was down"
        assert max(took) <= RESUME_BOUND_S, f"calls waited for a connection: {took}"
    finally:
        storage.close()
