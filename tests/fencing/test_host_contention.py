"""Four engine processes x 100 workflows append to host rows through the fence, under signals."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.fencing.host_contention import run_contention

pytestmark = [pytest.mark.slow, pytest.mark.soak]

PROCESSES = 4
WORKFLOWS = 100
DURATION_S = 6.0


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_fenced_histories_never_go_back_an_epoch(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    table = "t_" + uuid.uuid4().hex[:16]
    if backend == "sqlite":
        db_url = str(tmp_path / "shared.db")
        storage_url = f"sqlite:///{db_url}?table={table}"
    else:
        db_url = request.getfixturevalue("postgres_base_url")
        storage_url = f"{db_url}{'&' if '?' in db_url else '?'}table={table}"
    result = run_contention(
        backend=backend,
        storage_url=storage_url,
        db_url=db_url,
        tmp_path=tmp_path,
        processes=PROCESSES,
        workflows=WORKFLOWS,
        duration_s=DURATION_S,
    )
    print(f"\n{backend}: {result}")
    assert result.signals["SIGKILL"] == 1 and result.signals["SIGSTOP"] > 0
    # The killed contender never wrote its summary: its commits are in the table only.
    assert result.counts["fenced_committed"] > 0
    assert result.entries >= result.counts["fenced_committed"]
    assert result.handed_over > 0, "no workflow changed owner: nothing contended"
