"""``claims``, ``workflows`` and ``show`` on both backends: tables with human times, raw JSON."""

from __future__ import annotations

import json
import re

import pytest

from tests.cli.helpers import (
    HOUR_MS,
    ISO,
    abandon,
    assert_one_line_no_traceback,
    iso,
    leave_bare_claim,
    leave_claim,
    run_cli,
)
from tests.workflows.helpers import expires_at
from weft_sync import Ownership, keys, system_clock
from weft_sync.storage import Storage

# -- claims ----------------------------------------------------------------------------------


def test_claims_table_shows_holder_epoch_state_and_human_expiry(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-dead")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")
    storage.put(keys.workflow_owner_holder("wf-garbled"), b"\xc1 not a holder")

    code, out = run_cli("--url", storage_url, "claims")

    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["WORKFLOW", "HOLDER", "EPOCH", "STATE", "DRIVER", "EXPIRES"]
    by_id = {row.split()[0]: row for row in rows}
    assert set(by_id) == {"wf-dead", "wf-live", "wf-garbled"}
    dead_at = iso(expires_at(storage, "wf-dead") or 0)
    live_at = iso(expires_at(storage, "wf-live") or 0)
    # An hour back plus the 30 s TTL is 59 min ago; an hour ahead plus the TTL is in 60 min.
    # The live claim's engine crashed without a record left: its driver state is unknown.
    assert re.fullmatch(
        rf"wf-dead\s+dead-engine\s+1\s+expired\s+-\s+{dead_at} \(59 min ago\)",
        by_id["wf-dead"],
    )
    assert re.fullmatch(
        rf"wf-live\s+live-engine\s+1\s+live\s+unknown\s+{live_at} \(in 60 min\)",
        by_id["wf-live"],
    )
    assert re.fullmatch(r"wf-garbled\s+\(undecodable holder\)\s+-\s+-\s+-\s+-", by_id["wf-garbled"])


def test_claims_json_keeps_raw_milliseconds(storage_url: str, storage: Storage) -> None:
    abandon(storage_url, "wf-dead")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")

    code, out = run_cli("--url", storage_url, "claims", "--json")

    assert code == 0
    rows = {row["workflow_id"]: row for row in json.loads(out)}
    assert set(rows) == {"wf-dead", "wf-live"}
    dead, live = rows["wf-dead"], rows["wf-live"]
    assert (dead["engine_id"], dead["epoch"], dead["valid"]) == ("dead-engine", 1, True)
    assert (live["engine_id"], live["epoch"], live["valid"]) == ("live-engine", 1, True)
    assert (dead["driver"], live["driver"]) == (None, "unknown")
    assert dead["expires_at"] == expires_at(storage, "wf-dead")
    assert live["expires_at"] == expires_at(storage, "wf-live")
    assert live["claimed_at"] == live["expires_at"] - 30_000
    assert -HOUR_MS + 29_000 - 60_000 < dead["expires_in_ms"] < -HOUR_MS + 30_000
    assert HOUR_MS + 30_000 - 60_000 < live["expires_in_ms"] < HOUR_MS + 30_000


def test_claims_of_an_empty_store_print_only_the_header(storage_url: str, storage: Storage) -> None:
    code, out = run_cli("--url", storage_url, "claims")
    assert code == 0
    assert out.split() == ["WORKFLOW", "HOLDER", "EPOCH", "STATE", "DRIVER", "EXPIRES"]
    assert run_cli("--url", storage_url, "claims", "--json") == (0, "[]\n")


# -- workflows -------------------------------------------------------------------------------


@pytest.fixture
def three_workflows(storage_url: str) -> str:
    """wf-a completed, wf-b and wf-c running (released again); returns the URL."""
    with Ownership.open(storage_url, background="manual") as engine:
        for workflow_id in ("wf-a", "wf-b", "wf-c"):
            engine.workflows.start(workflow_id, "import", input={"n": 1})
        engine.workflows.complete("wf-a", result="done")
    return storage_url


def test_workflows_lists_every_record_with_type_status_and_human_update_time(
    three_workflows: str,
) -> None:
    code, out = run_cli("--url", three_workflows, "workflows")

    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["WORKFLOW", "TYPE", "STATUS", "UPDATED"]
    assert [row.split()[:3] for row in rows] == [
        ["wf-a", "import", "completed"],
        ["wf-b", "import", "running"],
        ["wf-c", "import", "running"],
    ]
    for row in rows:
        assert re.search(rf"\s{ISO} \((\d+ s ago|now)\)$", row), row


def test_workflows_filters_by_status_and_limit(three_workflows: str) -> None:
    code, out = run_cli("--url", three_workflows, "workflows", "--status", "running", "--json")
    assert code == 0
    records = json.loads(out)
    assert [r["workflow_id"] for r in records] == ["wf-b", "wf-c"]
    assert {r["type"] for r in records} == {"import"}
    assert records[0]["input"] == {"n": 1}
    assert 0 < records[0]["created_at"] <= system_clock()

    code, out = run_cli("--url", three_workflows, "workflows", "--status", "completed")
    assert code == 0
    assert [row.split()[0] for row in out.splitlines()[1:]] == ["wf-a"]

    code, out = run_cli("--url", three_workflows, "workflows", "--limit", "1", "--json")
    assert code == 0
    assert [r["workflow_id"] for r in json.loads(out)] == ["wf-a"]


def test_workflows_with_an_unknown_status_exit_2_naming_the_valid_ones(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli("--url", storage_url, "workflows", "--status", "bogus")

    assert (code, out) == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'bogus'", "running", "completed")


# -- show ------------------------------------------------------------------------------------


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines())


def test_show_prints_record_checkpoint_epoch_holder_with_human_times(
    storage_url: str, storage: Storage
) -> None:
    leave_claim(storage_url, "wf-1", offset_ms=HOUR_MS, engine_id="live-engine")
    storage.put(keys.workflow("wf-1") + ":ckpt", b"x" * 1234)

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = _fields(out)
    assert fields["workflow"] == "wf-1"
    assert (fields["type"], fields["status"]) == ("report", "running")
    assert fields["input"] == '{"pages": 3}'
    assert fields["checkpoint"] == "1234 bytes"
    assert fields["epoch"] == "1"
    assert re.fullmatch("[0-9a-f]{16}", fields["mint"])  # the epoch token's mint id
    assert fields["holder"] == "live-engine at epoch 1"
    assert fields["expires"] == f"{iso(expires_at(storage, 'wf-1') or 0)} (in 60 min)"
    assert fields["driver"] == "unknown"  # its engine crashed and left no record
    assert re.fullmatch(rf"{ISO} \(in 59 min\)", fields["claimed"])
    assert re.fullmatch(rf"{ISO} \(in 59 min\)", fields["created"])
    assert "result" not in fields


def test_show_of_a_completed_workflow_prints_its_result_and_no_holder(
    storage_url: str,
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1", result={"rows": 12})

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = _fields(out)
    assert fields["status"] == "completed"
    assert fields["result"] == '{"rows": 12}'
    assert fields["error"] == "-"
    assert re.fullmatch(rf"{ISO} \((\d+ s ago|now)\)", fields["finished"])
    assert fields["checkpoint"] == "(none)"
    assert fields["holder"] == "(none)"


def test_show_of_a_failed_workflow_prints_its_error(storage_url: str) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.fail("wf-1", KeyError("missing page"))

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = _fields(out)
    assert fields["status"] == "failed"
    assert json.loads(fields["error"]) == {"type": "KeyError", "message": "'missing page'"}


def test_show_json_has_record_outcome_checkpoint_epoch_and_holder_raw(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")
    storage.put(keys.workflow("wf-1") + ":ckpt", b"abc")

    code, out = run_cli("--url", storage_url, "show", "wf-1", "--json")

    assert code == 0
    data = json.loads(out)
    assert data["epoch"] == 1
    assert data["record"]["status"] == "running"
    assert data["record"]["input"] == {"pages": 3}
    assert data["checkpoint_bytes"] == 3
    assert data["outcome"] is None
    assert data["holder"]["engine_id"] == "dead-engine"
    assert data["holder"]["expires_at"] == expires_at(storage, "wf-1")
    assert data["holder"]["driver"] is None  # an expired claim has no driver state


def test_show_of_a_bare_claim_says_it_has_no_record(storage_url: str) -> None:
    leave_bare_claim(storage_url, "lock-1", offset_ms=0, engine_id="cron-1")

    code, out = run_cli("--url", storage_url, "show", "lock-1")

    assert code == 0
    fields = _fields(out)
    assert fields["record"] == "(none: a bare claim)"
    assert fields["holder"] == "cron-1 at epoch 1"


def test_show_of_an_unknown_workflow_exits_3(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "show", "nope") == (3, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'nope'")


def test_show_of_an_invalid_id_exits_2(
    storage_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "show", "") == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "non-empty")


def test_show_of_an_undecodable_record_says_so_and_still_shows_the_claim(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")
    storage.put(keys.workflow("wf-1"), b"\xc1 not a record")

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = _fields(out)
    assert fields["record"] == "('wf:wf-1' holds 14 bytes, not a valid workflow record)"
    assert fields["holder"] == "dead-engine at epoch 1"
    assert (
        json.loads(run_cli("--url", storage_url, "show", "wf-1", "--json")[1])["record_valid"]
        is False
    )


def test_ids_with_control_characters_cannot_forge_rows_or_escape_sequences(
    sqlite_url: str,
) -> None:
    """A workflow id may hold any character; a table row and ``show`` write the ones that do
    not print as escapes, so an id cannot start a row of its own or send a terminal escape."""
    forged = "wf-x\nwf-forged  import  completed"
    coloured = "wf-\x1b[31mred"
    with Ownership.open(sqlite_url, background="manual") as engine:
        engine.workflows.start(forged, "import")
        engine.workflows.start(coloured, "import")

    code, out = run_cli("--url", sqlite_url, "workflows")

    assert code == 0
    _header, *rows = out.splitlines()
    assert len(rows) == 2, out
    assert "\x1b" not in out
    assert rows[0].startswith("wf-\\x1b[31mred  "), rows
    assert rows[1].startswith("wf-x\\nwf-forged  import  completed  import  running"), rows
    code, out = run_cli("--url", sqlite_url, "show", forged)
    assert code == 0
    assert out.splitlines()[0] == "workflow    wf-x\\nwf-forged  import  completed"
