"""What the documentation promises about tuning constants and quiet operation holds for the code,
and the costs it quotes are the ones on its benchmarks page.

Each number is read from the page's own sentence and checked against behaviour (or against the
benchmarks page), so changing either the constant or the text alone fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.claims.gated import new_registry
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import WorkflowRecord, encode_workflow_record
from weft_sync.reclaim.discoveries import expiry_judge
from weft_sync.reclaim.engine_discovery import EngineIndexDiscovery
from weft_sync.reclaim.scan_windows import RotatingWindow
from weft_sync.storage import Put, Storage
from weft_sync.storage.cas import CasRow

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HOW_IT_WORKS = (DOCS / "how-it-works.md").read_text()


def _documented(pattern: str) -> int:
    found = re.search(pattern, HOW_IT_WORKS.replace("\n", " "))
    assert found, f"docs/how-it-works.md no longer says {pattern!r}"
    return int(found.group(1).replace(",", ""))


class _RowCounter:
    """Delegates to a real store; records how many rows each ``compare_and_set_many`` carried."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        self.calls.append(len(rows))
        result: list[bool] = self._inner.compare_and_set_many(rows)  # type: ignore[attr-defined]
        return result


def test_renewal_writes_as_many_claims_per_transaction_as_the_docs_say(
    storage: Storage,
) -> None:
    per_transaction = _documented(r"up to ([\d,]+) claims per transaction")
    counter = _RowCounter(storage)
    registry = new_registry(counter, ManualClock(1_000_000), "engine-a")  # type: ignore[arg-type]
    ids = [f"wf-{n:05d}" for n in range(per_transaction + 1)]
    for wid in ids:
        assert registry.acquire(wid).status == "acquired"

    results = registry.renew_many(ids)

    assert [r.status for r in results] == ["renewed"] * len(ids)
    assert counter.calls == [per_transaction, 1]


def test_the_backstop_windows_read_as_many_rows_per_pass_as_the_docs_say(
    storage: Storage,
) -> None:
    window = _documented(r"three rotating windows of ([\d,]+) rows each")
    assert _documented(r"`ceil\(N / ([\d,]+)\) \+ 1` passes") == window
    # Running records that no index names and no holder covers: only the record window finds
    # them (the store carries the index marker, so nothing is scanned in full).
    ids = [f"legacy-{n:05d}" for n in range(2 * window + 7)]
    storage.batch(
        [Put(keys.OWNER_INDEX_MARKER, b"indexed")]
        + [
            Put(keys.workflow(wid), encode_workflow_record(WorkflowRecord(wid, "job", "running")))
            for wid in ids
        ]
    )
    clock = ManualClock(1_000_000)
    discovery = EngineIndexDiscovery(
        storage, engine_id="reader", clock=clock, judge=expiry_judge(clock, 1_000)
    )

    passes = [discovery.discover(set()).candidates for _ in range(3)]

    assert [len(found) for found in passes] == [window, window, 7]
    assert sorted(passes[0] + passes[1] + passes[2]) == ids
    # The documented bound: every one of N keys is read within ceil(N / window) + 1 passes.
    assert RotatingWindow(keys.workflow(""), window).passes_to_cover(len(ids)) == 4


QUIET_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys, warnings
    root_before = list(logging.getLogger().handlers)
    import weft_sync
    from weft_sync import Ownership, OwnershipOptions
    with Ownership.open(
        sys.argv[1], options=OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s"),
        background="manual",
    ) as ownership:
        ledger = ownership.workflows
        ledger.start("wf-1", "job", input={"n": 1})
        ledger.save_checkpoint("wf-1", b"step-1")
        ownership.run_maintenance()
        ledger.complete("wf-1", result={"ok": True})
        with ownership.claim("bare-1"):
            ownership.run_maintenance()
    loggers = {
        name: [type(h).__name__ for h in logger.handlers]
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("weft_sync") and isinstance(logger, logging.Logger)
    }
    with open(sys.argv[2], "w") as out:
        json.dump({
            "root_changed": list(logging.getLogger().handlers) != root_before,
            "loggers": loggers,
        }, out)
    """
)


def test_the_library_installs_no_log_handlers_and_never_prints(
    storage_url: str, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT, storage_url, str(report)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # Nothing at all on either stream, warnings and log records included.
    assert proc.stdout == ""
    assert proc.stderr == ""
    state = json.loads(report.read_text())
    assert state["root_changed"] is False
    assert state["loggers"], "no weft_sync logger was created: the check saw nothing"
    assert all(handlers == [] for handlers in state["loggers"].values()), state["loggers"]


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def test_the_fence_costs_in_the_guide_are_the_ones_on_the_benchmarks_page() -> None:
    """The fencing guide's costs are the ranges of the benchmarks page's current fence table (one
    run per load, written ``a / b``) and its measured own work per block."""
    guide = re.sub(r"\s+", " ", (DOCS / "guides" / "fencing.md").read_text())
    times = "\u00d7"  # the multiplication sign the pages write ratios with
    dash = "\u2013"  # the en dash of a range
    found = re.search(
        rf"([\d.]+)(?:{dash}([\d.]+))?{times} on PostgreSQL with durable commits and "
        rf"([\d.]+)(?:{dash}([\d.]+))?{times} on SQLite.*?"
        r"the fence's own work on SQLite is ([\d.]+) µs per block",
        guide,
    )
    assert found, "docs/guides/fencing.md no longer quotes the fence's measured cost"
    pg_low, pg_high, sqlite_low, sqlite_high, own_work = found.groups()
    # One value where the runs agree, a range where they do not.
    pg_high, sqlite_high = pg_high or pg_low, sqlite_high or sqlite_low
    page = (DOCS / "benchmarks.md").read_text()
    fence = page[page.index("## Host-data fence") :]
    current = re.search(r"^### .*\(current\)$", fence, re.MULTILINE)
    assert current, "the benchmarks page's fence section has no subsection marked (current)"
    section = fence[current.start() :]
    later = re.search(r"^#{2,3} ", section[4:], re.MULTILINE)
    section = section if later is None else section[: later.start() + 4]
    rows = {row[0]: row for row in _table_rows(section) if len(row) == 3}

    def measured(backend: str) -> tuple[str, str]:
        runs = sorted(float(v.strip("*").rstrip(times)) for v in rows[backend][2].split(" / "))
        return f"{runs[0]:.2f}", f"{runs[-1]:.2f}"

    assert measured("PostgreSQL, `fsync=on`, `synchronous_commit=on`") == (pg_low, pg_high)
    assert measured("SQLite, WAL, `synchronous=FULL`") == (sqlite_low, sqlite_high)
    assert f"{own_work} µs best" in section
