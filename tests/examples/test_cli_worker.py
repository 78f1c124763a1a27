"""``examples/cli_worker.py``: two worker processes share one store; each item is done once."""

from __future__ import annotations

import io
import subprocess
from collections import Counter

import pytest

from tests.examples.helpers import WAIT_S, load_example, run_script, script_command, script_env
from tests.workflows.helpers import holder_engine
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

SCRIPT = "cli_worker.py"
ITEMS = 12


@pytest.mark.slow
def test_two_concurrent_workers_process_every_item_exactly_once(
    storage_url: str, storage: Storage
) -> None:
    worker = load_example(SCRIPT)
    assert worker.seed(storage_url, ITEMS, 2, io.StringIO()) == 0
    item_ids = [f"item-{n:03d}" for n in range(ITEMS)]

    procs = [
        subprocess.Popen(
            script_command(SCRIPT, "--url", storage_url, "work", "--name", name),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=script_env(),
        )
        for name in ("w1", "w2")
    ]
    try:
        outputs = [proc.communicate(timeout=WAIT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert (proc.returncode, stderr) == (0, "")
    processed_by: dict[str, list[str]] = {}
    for stdout, _ in outputs:
        for line in stdout.splitlines():
            name, verb, *rest = line.split()
            if verb == "processed":
                processed_by.setdefault(rest[0], []).append(name)
    assert sorted(processed_by) == item_ids
    assert Counter(len(names) for names in processed_by.values()) == {1: ITEMS}
    ledger = Workflows(storage)
    for item_id, (name,) in processed_by.items():
        outcome = ledger.get_outcome(item_id)
        assert outcome is not None
        assert (outcome.status, outcome.result) == ("completed", {"worker": name})
        assert ledger.load_checkpoint(item_id) == f"2/2 by {name}".encode()
        assert holder_engine(storage, item_id) is None


@pytest.mark.slow
def test_self_contained_mode_checks_exactly_once_itself() -> None:
    done = run_script(SCRIPT)

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-1] == ("8 items, all completed: True, each exactly once: True")
