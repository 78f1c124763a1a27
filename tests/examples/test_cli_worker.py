"""``examples/cli_worker.py``: worker processes drive items through a handler; each is done once.

The handler is called with a ``ReclaimedWorkflow`` by each worker's reclaim pass, for seeded
items nobody holds and for the item of a worker that was SIGKILLed.
"""

from __future__ import annotations

import io
import signal
import subprocess
from collections import Counter

import pytest

from tests.examples.helpers import WAIT_S, load_example, run_script, script_command, script_env
from tests.workflows.helpers import holder_engine, stored_epoch
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


@pytest.mark.slow
def test_a_killed_workers_item_is_taken_over_and_finished_by_another_worker(
    storage_url: str, storage: Storage
) -> None:
    worker = load_example(SCRIPT)
    assert worker.seed(storage_url, 4, 2, io.StringIO()) == 0
    # One item at a time, and a step long enough to be killed in the middle of it.
    slow = subprocess.Popen(
        script_command(
            SCRIPT,
            "--url",
            storage_url,
            "work",
            "--name",
            "w1",
            "--step-ms",
            "60000",
            "--concurrency",
            "1",
        ),
        stdout=subprocess.PIPE,
        text=True,
        env=script_env(),
    )
    try:
        assert slow.stdout is not None
        started = slow.stdout.readline().split()
        assert started[:2] == ["w1", "started"], started
        victim = started[2]
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.communicate(timeout=WAIT_S)
    assert holder_engine(storage, victim) is not None  # the dead worker's claim is left behind

    done = subprocess.run(
        script_command(SCRIPT, "--url", storage_url, "work", "--name", "w2"),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=script_env(),
        check=False,
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert f"w2 processed {victim}" in done.stdout.splitlines()
    ledger = Workflows(storage)
    for number in range(4):
        item_id = f"item-{number:03d}"
        outcome = ledger.get_outcome(item_id)
        assert outcome is not None
        assert (outcome.status, outcome.result) == ("completed", {"worker": "w2"})
        assert holder_engine(storage, item_id) is None
    # Seeded at epoch 1, claimed by w1 at 2, taken over from the dead w1 at 3.
    assert stored_epoch(storage, victim) == 3
