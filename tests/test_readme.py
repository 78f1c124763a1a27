"""The README's first example runs as written and leaves the store in the state it describes.

(Every other example of the README and the guides is run by ``tests/test_docs_examples.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weft_sync import keys
from weft_sync.codec import decode_epoch
from weft_sync.storage import SqliteStorage
from weft_sync.workflows import Workflows

README = Path(__file__).resolve().parent.parent / "README.md"


def _plain_script_example() -> str:
    text = README.read_text()
    section = text[text.index("## A plain script") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "the README's plain-script section has no python example"
    return found.group(1)


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(_plain_script_example(), str(README), "exec"), namespace)

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


def test_the_readme_stays_short_enough_to_read_top_to_bottom() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    for heading in ("## Set up", "## A plain script", "## Flask", "## Django", "## Cron"):
        assert any(line.startswith(heading) for line in lines), heading


def test_the_readme_set_up_commands_are_the_ones_ci_runs() -> None:
    text = README.read_text()
    setup = text[text.index("## Set up") :]
    block = re.search(r"```sh\n(.*?)```", setup, re.S)
    assert block, "the README's set-up section has no commands"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert commands == ['python -m pip install -e ".[test]"', "python -m pytest"]
    ci = (README.parent / ".ci" / "run").read_text()
    for command in commands:
        assert command.replace("pip install", "pip install -q") in ci or command in ci, command
