"""complete()/fail() inside a fenced block commit in the host's transaction, release included.

The host's final row and the workflow's end are one transaction: both commit, or neither does;
after a rollback the claim is still held and renewed, and the workflow still running. Every
driver of :data:`tests.fencing.hosts.CASES`, both backends.
"""

from __future__ import annotations

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
