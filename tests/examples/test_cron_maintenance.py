"""``examples/cron_maintenance.py``: one pass reclaims abandoned workflows and resumes them."""

from __future__ import annotations

import io

import pytest

from tests.examples.helpers import abandon, load_example, run_script
from tests.reliability.faulty import FaultyStorage
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

SCRIPT = "cron_maintenance.py"


def test_one_pass_resumes_abandoned_batches_from_their_checkpoint(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "inv-1", "invoice-batch", input={"invoices": 4}, checkpoint=b"2")
    abandon(storage_url, "pay-1", "payroll")

    done = run_script(SCRIPT, "--url", storage_url)

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "renewed 0, reclaimed 1 of 2 candidates",
        "  inv-1: reclaimed, completed with {'sent': 4, 'resumed_after': 2}",
        "  pay-1: not-eligible",
    ]
    ledger = Workflows(storage)
    assert ledger.get("inv-1").status == "completed"  # type: ignore[union-attr]
    assert ledger.load_checkpoint("inv-1") == b"4"
    assert (stored_epoch(storage, "inv-1"), holder_engine(storage, "inv-1")) == (2, None)
    # A type without a handler is left to whoever can run it.
    assert ledger.get("pay-1").status == "running"  # type: ignore[union-attr]
    assert (stored_epoch(storage, "pay-1"), holder_engine(storage, "pay-1")) == (1, "dead-engine")


def test_a_resume_that_raises_keeps_the_workflow_running_and_exits_1(
    storage_url: str, storage: Storage
) -> None:
    cron = load_example(SCRIPT)
    abandon(storage_url, "inv-1", "invoice-batch", input={"invoices": 4}, checkpoint=b"garbled")
    out = io.StringIO()

    assert cron.run_pass(storage_url, out) == 1

    lines = out.getvalue().splitlines()
    assert lines[0] == "renewed 0, reclaimed 0 of 1 candidates"
    assert lines[1].startswith("  inv-1: error (ValueError(")
    assert Workflows(storage).get("inv-1").status == "running"  # type: ignore[union-attr]
    # Taken over, then released when the script closed: another run can try again.
    assert (stored_epoch(storage, "inv-1"), holder_engine(storage, "inv-1")) == (2, None)


def test_a_failed_discovery_exits_1_and_takes_nothing_over(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    cron = load_example(SCRIPT)
    abandon(storage_url, "inv-1", "invoice-batch", input={"invoices": 1})
    failing_scans = FaultyStorage(storage, rate=1.0, kinds=("before",), methods=["scan"])
    out = io.StringIO()

    assert cron.run_pass(failing_scans, out) == 1

    assert out.getvalue() == ""
    assert capsys.readouterr().err == (
        "reclaim discovery failed: injected fault: scan() failed before it reached the store\n"
    )
    assert (stored_epoch(storage, "inv-1"), holder_engine(storage, "inv-1")) == (1, "dead-engine")


def test_demo_mode_runs_in_a_temporary_store() -> None:
    done = run_script(SCRIPT, "--demo")

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[0] == "renewed 0, reclaimed 2 of 3 candidates"
    assert "  payroll-march: not-eligible" in done.stdout.splitlines()
