"""complete()/fail() inside a fenced block commit in the host's transaction, release included.

The host's final row and the workflow's end are one transaction: both commit, or neither does;
after a rollback the claim is still held and renewed, and the workflow still running. Every
driver of :data:`tests.fencing.hosts.CASES`, both backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fencing.hosts import HostEnv
from tests.workflows.helpers import holder_engine
from weft_sync.errors import EngineDeposedError, WorkflowClaimLostWarning


def _status(env: HostEnv, wid: str) -> str:
    own = env.ownership()
    record = own.workflows.get(wid)
    assert record is not None
    return record.status


def test_complete_inside_the_fence_commits_with_the_host_row(env: HostEnv) -> None:
    own = env.ownership()
    own.workflows.start("job-1", "report")
    conn = env.connect()
    with own.fenced("job-1", conn) as handle:
        env.write(handle, "report-1", "done")
        own.workflows.complete("job-1", {"rows": 3})
        # Not committed yet: nothing of it is visible outside the host's transaction.
        assert own.registry.current_epoch("job-1") == 1
    assert env.rows() == {"report-1": "done"}
    assert _status(env, "job-1") == "completed"
    assert own.registry.current_epoch("job-1") is None
    assert holder_engine(own.storage, "job-1") is None
    outcome = own.workflows.get_outcome("job-1")
    assert outcome is not None and outcome.result == {"rows": 3}


def test_a_block_that_raises_after_complete_rolls_back_both_and_keeps_the_claim(
    env: HostEnv,
) -> None:
    own = env.ownership()
    own.workflows.start("job-1", "report")
    conn = env.connect()
    with pytest.raises(RuntimeError, match="killed"), own.fenced("job-1", conn) as handle:
        env.write(handle, "report-1", "done")
        own.workflows.fail("job-1", "boom")
        raise RuntimeError("killed between the final write and the commit")
    assert env.rows() == {}
    assert _status(env, "job-1") == "running"
    assert own.registry.current_epoch("job-1") == 1
    assert holder_engine(own.storage, "job-1") == own.engine_id
    # Renewals resume after the rollback, and a later finish commits.
    result = own.run_maintenance()
    assert result.renewed_count == 1
    own.workflows.complete("job-1")
    assert _status(env, "job-1") == "completed"


def test_a_deposed_owner_finishing_in_a_fence_is_refused_before_anything_is_written(
    env: HostEnv,
) -> None:
    own = env.ownership()
    own.workflows.start("job-1", "report")
    conn = env.connect()
    with own.fenced("job-1", conn) as handle:
        env.write(handle, "report-1", "draft")
    env.take_over("job-1")
    with (
        pytest.raises(EngineDeposedError),
        pytest.warns(WorkflowClaimLostWarning),
        own.fenced("job-1", conn) as handle,
    ):
        env.write(handle, "report-1", "done")
        own.workflows.complete("job-1")
    assert env.rows() == {"report-1": "draft"}
    assert _status(env, "job-1") == "running"


def test_complete_in_a_sqlite_fence_does_not_wait_for_a_renewal_blocked_behind_it(
    tmp_path: Path,
) -> None:
    import sqlite3
    import threading
    import time

    from tests.claims.gated import WarningSink
    from tests.fencing.hosts import make_env

    env = make_env("sqlite", "sqlite3", tmp_path, None)
    try:
        sink = WarningSink()
        own = env.ownership(storage=env.storage_url + "&busy_timeout_ms=20000", warn=sink)
        own.workflows.start("job-1", "report")
        own.drivers.enter("job-1", 1, "the test's thread")
        conn = sqlite3.connect(env.db_url, timeout=20.0, check_same_thread=False)
        renewals: list[object] = []
        with own.fenced("job-1", conn) as handle:
            env.write(handle, "report-1", "done")
            # A renewal pass now waits for this transaction's write lock.
            renewer = threading.Thread(target=lambda: renewals.append(own.run_maintenance()))
            renewer.start()
            deadline = time.monotonic() + 10
            while "job-1" not in own.registry._table.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "job-1" in own.registry._table.in_flight, "no renewal got in flight"
            started = time.monotonic()
            own.workflows.complete("job-1")
            assert time.monotonic() - started < 2.0  # not the 20 s busy timeout
        renewer.join(30)
        conn.close()
        assert env.rows() == {"report-1": "done"}
        assert own.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]
        assert sink.received == []  # the renewal that lost its holder is no lost claim
    finally:
        env.close()
