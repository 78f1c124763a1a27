"""What one acquire + release cycle sends to SQLite, as the benchmarks page states it.

The statements are traced on the store's own write connection (``set_trace_callback``), and
the number is read from the page's table, so changing the code or the text alone fails here.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from tests.claims.gated import new_registry
from weft_sync.clock import ManualClock
from weft_sync.storage import SqliteStorage

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def _documented_statements() -> int:
    row = next(
        line
        for line in BENCHMARKS.read_text().splitlines()
        if line.startswith("| statements / round trips |")
    )
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    found = re.match(r"(\d+) \(", cells[2])  # the "SQLite now" column
    assert found, f"the benchmarks page's statements row changed shape: {row!r}"
    return int(found.group(1))


def test_an_acquire_and_release_cycle_sends_the_documented_statements(tmp_path: Path) -> None:
    with SqliteStorage(tmp_path / "store.db", table="kv") as store:
        registry = new_registry(store, ManualClock(1_000_000))
        registry.acquire("warm-up")
        registry.release("warm-up")
        writer = store._writer
        assert writer is not None
        conn = writer.connection
        assert isinstance(conn, sqlite3.Connection)
        sent: list[str] = []
        conn.set_trace_callback(sent.append)
        try:
            assert registry.acquire("wf").status == "acquired"
            acquire = list(sent)
            assert registry.release("wf").status == "released"
        finally:
            conn.set_trace_callback(None)
        registry.close()
    # executemany traces each row, so a run of writes of one kind counts as the one call it is
    # (three REPLACE executes in a row would count once too: the rows are checked below).
    writes = ("REPLACE", "DELETE")
    calls = [
        s
        for i, s in enumerate(sent)
        if i == 0 or s.split()[0] not in writes or s.split()[0] != sent[i - 1].split()[0]
    ]
    assert len(calls) == _documented_statements()
    kinds = [s.split()[0] for s in calls]
    transaction = ["BEGIN", "SELECT", "SELECT"]
    assert kinds == [*transaction, "REPLACE", "COMMIT", *transaction, "DELETE", "COMMIT"]
    # The holder and epoch (acquire), the epoch and holder conditions (release): a lookup each.
    assert all(" IN " not in s for s in calls if s.startswith("SELECT"))
    assert sum(s.startswith("REPLACE") for s in acquire) == 3  # epoch, holder, by-engine entry
    assert not any("SAVEPOINT" in s for s in sent)
