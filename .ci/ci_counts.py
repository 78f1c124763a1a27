"""A pytest plugin for ``.ci/run``: count what a run collected, deselected, ran and skipped.

Loaded with ``-p ci_counts`` (``.ci`` on ``PYTHONPATH``); writes the counts as JSON to the file
``$WEFT_CI_COUNTS`` names when the session ends. A test counts as run when its call phase ran
(passed, failed, xfailed or xpassed); as skipped when it was skipped in setup or call. Each
deselected test is listed with its markers, so the caller can tell a soak left to its own step
from a test something else deselected.

Under pytest-xdist the workers collect and the controller receives every test's reports: each
worker sends what it collected and deselected back through ``workeroutput``, the controller
checks that the workers agree, counts the reports and alone writes the file.
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
    "workers": 0,
}
# What each xdist worker collected: (selected, deselected node ids), for the agreement check.
_collections: list[tuple[int, list[dict[str, Any]]]] = []


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        markers = sorted({mark.name for mark in item.iter_markers()})
        _counts["deselected"].append({"nodeid": item.nodeid, "markers": markers})


def pytest_collection_finish(session: pytest.Session) -> None:
    _counts["selected"] = len(session.items)
    if _is_worker(session.config):
        output = session.config.workeroutput  # type: ignore[attr-defined]
        output["ci_counts_selected"] = len(session.items)
        output["ci_counts_deselected"] = list(_counts["deselected"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    output = getattr(node, "workeroutput", None) or {}
    if "ci_counts_selected" in output:
        _collections.append((output["ci_counts_selected"], output["ci_counts_deselected"]))


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
    if _is_worker(session.config):
        return  # the controller counts the reports and writes the file
    if _collections:
        _counts["workers"] = len(_collections)
        # Every worker collects the whole suite (xdist refuses differing collections too); a
        # disagreement is written down for the caller to fail the run on.
        sizes = sorted({n for n, _ in _collections})
        _counts["selected"] = max(sizes)
        if len(sizes) > 1:
            _counts["collection_mismatch"] = sizes
        _counts["deselected"] = _collections[0][1]
    target = os.environ.get("WEFT_CI_COUNTS")
    if target:
        with open(target, "w", encoding="utf-8") as out:
            json.dump({**_counts, "exitstatus": int(exitstatus)}, out)
