"""The Flask example as its gunicorn tests run and read it.

How gunicorn serves it, the per-worker event logs it writes (``events-<pid>.jsonl``: steps,
completions, refusals, resumptions, with times), whether a stopped worker sits inside a store
transaction, and the checks that a paused worker's late writes were refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from tests.examples.gunicorn_harness import write_locks_held
from tests.support.postgres_activity import dsn_of, idle_in_transaction

APP_SPEC: Final = "examples.flask_app.app:create_app()"
CONFIG: Final = "examples/flask_app/gunicorn.conf.py"


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every event the workers logged in ``directory``, oldest first."""
    found = []
    for path in directory.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            # A line cut short by SIGKILL is not evidence of anything.
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return sorted(found, key=lambda e: e["t"])


def assert_stale_writes_refused(log: list[dict[str, Any]], stopped: int) -> int:
    """The paused worker had writes refused, and no stale write was accepted; return how many."""
    refused = [e for e in log if e["event"] == "refused" and e["pid"] == stopped]
    assert refused, "the paused worker had no write refused"
    assert_no_stale_write_accepted(log)
    return len(refused)


def assert_no_stale_write_accepted(log: list[dict[str, Any]]) -> None:
    """No write at an older epoch issued after a takeover was accepted.

    A takeover of a job at epoch ``e`` is logged (``resumed``) right after it committed; every
    write at an older epoch issued after that must have been refused by the store.
    """
    takeovers: dict[str, list[tuple[float, int]]] = {}
    for event in log:
        if event["event"] == "resumed":
            takeovers.setdefault(event["job"], []).append((event["t"], event["epoch"]))
    for event in log:
        if event["event"] not in ("step", "completed"):
            continue
        for taken_at, epoch in takeovers.get(event["job"], []):
            if epoch > event["epoch"]:
                assert event["issued"] < taken_at, ("a stale write was accepted", event, epoch)


def busy_probe(backend: str, storage_url: str) -> Callable[[int], bool]:
    """Whether a stopped worker is inside a store transaction (then it is continued and retried).

    A process paused while it holds the store's write lock stalls every writer on SQLite, and
    on PostgreSQL holds its row locks; the scenario here is a worker paused between writes.
    """
    if backend == "sqlite":
        return lambda pid: bool(write_locks_held(pid))
    dsn, table = dsn_of(storage_url)
    return lambda pid: idle_in_transaction(dsn, table=table)
