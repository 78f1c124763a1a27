"""A pytest plugin for ``.ci/run``: count what a run collected, deselected, ran and skipped.

Loaded with ``-p ci_counts`` (``.ci`` on ``PYTHONPATH``); writes the counts as JSON to the file
``$WEFT_CI_COUNTS`` names when the session ends. A test counts as run when its call phase ran
(passed, failed, xfailed or xpassed); as skipped when it was skipped in setup or call. Each
deselected test is listed with its markers, so the caller can tell a soak left to its own step
from a test something else deselected.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_counts: dict[str, Any] = {
    "selected": 0,
    "deselected": [],
    "ran": 0,
    "skipped": 0,
    "failed": 0,
    "errors": 0,
}


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        markers = sorted({mark.name for mark in item.iter_markers()})
        _counts["deselected"].append({"nodeid": item.nodeid, "markers": markers})


def pytest_collection_finish(session: pytest.Session) -> None:
    _counts["selected"] = len(session.items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        if report.when in ("setup", "call"):
            _counts["skipped"] += 1
        return
    if report.when == "call":
        _counts["ran"] += 1
        if report.failed:
            _counts["failed"] += 1
    elif report.failed:
        _counts["errors"] += 1  # setup or teardown: a setup error means the test did not run


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("WEFT_CI_COUNTS")
    if target:
        with open(target, "w", encoding="utf-8") as out:
            json.dump({**_counts, "exitstatus": int(exitstatus)}, out)
