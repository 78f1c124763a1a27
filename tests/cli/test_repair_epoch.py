"""``doctor`` names corrupt epoch keys; ``repair-epoch`` replaces one so the workflow runs again."""

from __future__ import annotations

import pytest

from tests.cli.helpers import run_cli
from weft_sync import Ownership, keys
from weft_sync.codec import decode_epoch
from weft_sync.errors import CorruptEpochError
from weft_sync.storage import Storage

CORRUPT = b"\x01\x02\x03"  # three bytes: an epoch is eight


def _corrupt_epoch_of_a_started_workflow(storage_url: str, storage: Storage) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    storage.put(keys.workflow_owner_epoch("wf-1"), CORRUPT)


def test_doctor_names_a_corrupt_epoch_key_and_the_repair(
    storage_url: str, storage: Storage
) -> None:
    _corrupt_epoch_of_a_started_workflow(storage_url, storage)

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 1
    assert "[FAIL] epoch keys: 1 do not decode" in out
    assert "'wf-owner-epoch:wf-1' (3 bytes): refused until repaired with " in out
    assert "'weft-sync repair-epoch wf-1'" in out
    # Read-only: the report changed nothing.
    assert storage.get(keys.workflow_owner_epoch("wf-1")) == CORRUPT


def test_doctor_reports_healthy_epoch_keys(storage_url: str) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    code, out = run_cli("--url", storage_url, "doctor")
    assert "[ok] epoch keys: every one decodes" in out
    assert code == 0, out


def test_repair_epoch_writes_a_high_epoch_and_the_workflow_can_be_resumed(
    storage_url: str, storage: Storage
) -> None:
    _corrupt_epoch_of_a_started_workflow(storage_url, storage)
    with (
        Ownership.open(storage_url, background="manual") as engine,
        pytest.raises(CorruptEpochError, match="repair"),
    ):
        engine.workflows.resume("wf-1")

    code, out = run_cli("--url", storage_url, "repair-epoch", "wf-1", "--at-least", "9000")

    assert code == 0, out
    repaired = decode_epoch(storage.get(keys.workflow_owner_epoch("wf-1")))
    assert repaired is not None and repaired >= 9000
    assert out == f"wf-1: epoch repaired, now {repaired}; its former holder is deposed\n"
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    with Ownership.open(storage_url, background="manual") as engine:
        record = engine.workflows.resume("wf-1")
        assert record.status == "running"
        assert engine.registry.current_epoch("wf-1") == repaired + 1


def test_repair_epoch_refuses_a_valid_epoch_and_a_missing_one(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    assert run_cli("--url", storage_url, "repair-epoch", "wf-1") == (1, "")
    assert "holds a valid epoch (1)" in capsys.readouterr().err
    assert decode_epoch(storage.get(keys.workflow_owner_epoch("wf-1"))) == 1
    assert run_cli("--url", storage_url, "repair-epoch", "never-seen") == (3, "")
    assert "no epoch key" in capsys.readouterr().err
