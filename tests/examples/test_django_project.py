"""``examples/django_project``: the ``weft_maintain`` management command, run through manage.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.helpers import EXAMPLES, abandon, run_script
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

PROJECT = EXAMPLES / "django_project"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'maintain.db'}"


@pytest.mark.slow
def test_weft_maintain_once_resumes_an_abandoned_report_with_its_handler(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "report-1", "report", input={"pages": 4}, checkpoint=b"2")
    abandon(storage_url, "import-1", "import")

    done = run_script(
        "django_project/manage.py", "weft_maintain", "--url", storage_url, "--once", cwd=PROJECT
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "pass 1: renewed 0, reclaimed 1 of 2 candidates",
        "  resumed report-1: completed",
    ]
    ledger = Workflows(storage)
    outcome = ledger.get_outcome("report-1")
    assert outcome is not None
    assert (outcome.status, outcome.result) == ("completed", {"pages": 4, "resumed_after": 2})
    assert ledger.load_checkpoint("report-1") == b"4"
    assert (stored_epoch(storage, "report-1"), holder_engine(storage, "report-1")) == (2, None)
    # No handler is registered for "import": not taken over.
    assert ledger.get("import-1").status == "running"  # type: ignore[union-attr]
    assert holder_engine(storage, "import-1") == "dead-engine"


@pytest.mark.slow
def test_weft_maintain_interval_stops_after_the_passes_asked_for(sqlite_url: str) -> None:
    abandon(sqlite_url, "report-1", "report", input={"pages": 1})

    done = run_script(
        "django_project/manage.py",
        "weft_maintain",
        "--url",
        sqlite_url,
        "--interval",
        "--passes",
        "2",
        "--renew-interval",
        "50ms",
        "--claim-ttl",
        "1s",
        cwd=PROJECT,
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "pass 1: renewed 0, reclaimed 1 of 1 candidates",
        "  resumed report-1: completed",
        "pass 2: renewed 0, reclaimed 0 of 0 candidates",
        "stopping after 2 passes; releasing claims",
    ]


def test_weft_maintain_refuses_unsafe_claim_timing_with_exit_2(sqlite_url: str) -> None:
    done = run_script(
        "django_project/manage.py",
        "weft_maintain",
        "--url",
        sqlite_url,
        "--claim-ttl",
        "1s",
        "--renew-interval",
        "1s",
        cwd=PROJECT,
    )

    assert done.returncode == 2
    assert "claim_renew_interval (1000ms) to be strictly less than claim_ttl" in done.stderr
    assert "Traceback" not in done.stderr
