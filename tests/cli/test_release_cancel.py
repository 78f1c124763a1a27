"""``release`` clears a bare claim, ``cancel`` a workflow; both depose the holder by epoch."""

from __future__ import annotations

import pytest

from tests.cli.helpers import (
    HOUR_MS,
    abandon,
    assert_one_line_no_traceback,
    leave_bare_claim,
    run_cli,
    run_cli_process,
)
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import (
    EngineDeposedError,
    Ownership,
    WorkflowClaimLostWarning,
    WorkflowClaimUnavailableError,
    keys,
)
from weft_sync.storage import Put, Storage

# -- release ---------------------------------------------------------------------------------


def test_release_clears_a_crashed_bare_claim_so_claim_works_again(
    storage_url: str, storage: Storage
) -> None:
    leave_bare_claim(storage_url, "nightly-report", offset_ms=HOUR_MS, engine_id="crashed-cron")
    with Ownership.open(storage_url, background="manual") as cron:
        with pytest.raises(WorkflowClaimUnavailableError), cron.claim("nightly-report"):
            pytest.fail("the crashed holder's claim is live for another hour")

        code, out = run_cli("--url", storage_url, "release", "nightly-report")

        assert code == 0
        assert out.startswith("nightly-report: released (held by crashed-cron, a live claim, ")
        assert out.endswith("; epoch now 2)\n")
        assert holder_engine(storage, "nightly-report") is None
        assert stored_epoch(storage, "nightly-report") == 2
        with cron.claim("nightly-report") as handle:
            assert handle.epoch == 3


def test_release_deposes_a_live_holder_whose_fenced_writes_then_fail(
    storage_url: str, storage: Storage
) -> None:
    with Ownership.open(storage_url, background="manual") as holder:
        assert holder.registry.acquire("lock-1").status == "acquired"
        holder.workflows.fenced_write("lock-1", [Put("report:lock-1", b"before")])

        assert run_cli("--url", storage_url, "release", "lock-1")[0] == 0

        with pytest.warns(WorkflowClaimLostWarning), pytest.raises(EngineDeposedError):
            holder.workflows.fenced_write("lock-1", [Put("report:lock-1", b"after")])
    assert storage.get("report:lock-1") == b"before"
    assert stored_epoch(storage, "lock-1") == 2


def test_release_of_an_expired_bare_claim_says_it_had_expired(
    storage_url: str, storage: Storage
) -> None:
    leave_bare_claim(storage_url, "lock-1", offset_ms=-HOUR_MS, engine_id="gone")

    code, out = run_cli("--url", storage_url, "release", "lock-1")

    assert code == 0
    assert out.startswith("lock-1: released (held by gone, expired, expiry ")
    assert "(59 min ago)" in out


def test_release_refuses_a_running_workflow_and_points_to_cancel(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    abandon(storage_url, "wf-1")
    before = dict(storage.scan(""))

    assert run_cli("--url", storage_url, "release", "wf-1") == (1, "")

    assert_one_line_no_traceback(
        capsys.readouterr().err, "'wf-1' is a running workflow", "weft-sync cancel wf-1"
    )
    assert dict(storage.scan("")) == before


def test_release_with_no_claim_exits_3(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "release", "nothing-here") == (3, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "no claim on 'nothing-here'")


def test_release_of_a_finished_workflow_without_a_holder_exits_3(
    storage_url: str, storage: Storage
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1")
    before = dict(storage.scan(""))

    assert run_cli("--url", storage_url, "release", "wf-1") == (3, "")
    assert dict(storage.scan("")) == before


def test_entry_point_release(sqlite_url: str) -> None:
    leave_bare_claim(sqlite_url, "lock-1", offset_ms=0, engine_id="cron-1")

    done = run_cli_process("release", "lock-1", "--url", sqlite_url)

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("lock-1: released (held by cron-1")


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_marks_the_workflow_cancelled_and_deposes_its_owner(
    storage_url: str, storage: Storage
) -> None:
    with Ownership.open(storage_url, background="manual") as owner:
        owner.workflows.start("wf-1", "report")
        assert stored_epoch(storage, "wf-1") == 1

        code, out = run_cli("--url", storage_url, "cancel", "wf-1")

        assert (code, out) == (0, "wf-1: cancelled (epoch now 2)\n")
        assert owner.workflows.get("wf-1").status == "cancelled"  # type: ignore[union-attr]
        assert holder_engine(storage, "wf-1") is None
        with pytest.warns(WorkflowClaimLostWarning), pytest.raises(EngineDeposedError):
            owner.workflows.save_checkpoint("wf-1", b"a late step")
    assert storage.get(keys.workflow("wf-1") + ":ckpt") is None


def test_cancel_of_an_unknown_workflow_exits_3(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "cancel", "nope") == (3, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'nope'")


def test_cancel_of_a_finished_workflow_exits_1_and_changes_nothing(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1")
    before = dict(storage.scan(""))

    assert run_cli("--url", storage_url, "cancel", "wf-1") == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "'wf-1'", "completed")
    assert dict(storage.scan("")) == before
