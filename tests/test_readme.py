"""The README's code example runs as written and leaves the store in the state it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weft_sync import keys
from weft_sync.codec import decode_epoch
from weft_sync.storage import SqliteStorage
from weft_sync.workflows import Workflows

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)

    with SqliteStorage(tmp_path / "jobs.db") as store:
        ledger = Workflows(store, None)
        record = ledger.get("payout-42")
        assert record is not None
        assert (record.type, record.status, record.input) == (
            "payout",
            "completed",
            {"amount": 1200},
        )
        outcome = ledger.get_outcome("payout-42")
        assert outcome is not None and outcome.result == {"ok": True}
        assert ledger.load_checkpoint("payout-42") == b"step-1 done"
        # Both claims were released on the way out; their epochs stay as fences.
        for wid in ("payout-42", "nightly-report"):
            assert store.get(keys.workflow_owner_holder(wid)) is None
            assert decode_epoch(store.get(keys.workflow_owner_epoch(wid))) == 1
