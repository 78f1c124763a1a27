"""``status`` and ``metrics``: the fleet's state as the store records it, on both backends."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli.helpers import HOUR_MS, ISO, abandon, iso, leave_claim, run_cli
from tests.workflows.helpers import expires_at
from weft_sync import Ownership, keys
from weft_sync.storage import Storage


@pytest.fixture
def fleet(storage_url: str, storage: Storage) -> str:
    """Two claims of a dead engine, one of a live one, a garbled holder, an unheld running one.

    ``wf-unheld`` was started and released gracefully: running, in the index, no holder.
    """
    abandon(storage_url, "wf-dead-1")
    abandon(storage_url, "wf-dead-2")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")
    with Ownership.open(storage_url, background="manual", engine_id="polite") as engine:
        engine.workflows.start("wf-unheld", "report")
    storage.put(keys.workflow_owner_holder("wf-garbled"), b"\xc1 not a holder")
    return storage_url


def test_status_json_counts_claims_per_engine_expired_and_unheld(
    fleet: str, storage: Storage
) -> None:
    code, out = run_cli("--url", fleet, "status", "--json")

    assert code == 0
    view = json.loads(out)
    assert view["claims"] == {"total": 4, "live": 1, "expired": 2, "undecodable": 1}
    assert view["engines"] == {
        "dead-engine": {"live": 0, "expired": 2},
        "live-engine": {"live": 1, "expired": 0},
    }
    assert view["oldest_expires_at"] == min(
        expires_at(storage, "wf-dead-1") or 0, expires_at(storage, "wf-dead-2") or 0
    )
    assert view["running"] == 4
    assert view["running_without_holder"] == ["wf-unheld"]


def test_status_table_is_human_readable(fleet: str, storage: Storage) -> None:
    code, out = run_cli("--url", fleet, "status")

    assert code == 0
    oldest = iso(expires_at(storage, "wf-dead-1") or 0)
    lines = out.splitlines()
    assert lines[0].split(None, 1)[1] == fleet
    assert lines[1:5] == [
        "claims                  4 (1 live, 2 expired, 1 undecodable)",
        f"oldest expiry           {oldest} (59 min ago)",
        "running workflows       4",
        "running, no holder      1 (wf-unheld)",
    ]
    assert [line.split() for line in lines[6:]] == [
        ["ENGINE", "LIVE", "EXPIRED"],
        ["dead-engine", "0", "2"],
        ["live-engine", "1", "0"],
    ]


def test_status_of_an_empty_store(storage_url: str, storage: Storage) -> None:
    code, out = run_cli("--url", storage_url, "status")

    assert code == 0
    assert "claims                  0 (0 live, 0 expired, 0 undecodable)\n" in out
    assert "oldest expiry           -\n" in out
    assert "ENGINE" not in out


@pytest.mark.parametrize("argv", [["metrics"], ["metrics", "--store"]], ids=["plain", "store"])
def test_metrics_prints_store_gauges_that_prometheus_parses(fleet: str, argv: list[str]) -> None:
    code, out = run_cli("--url", fleet, *argv)

    assert code == 0
    families = {f.name: f for f in text_string_to_metric_families(out)}
    assert {f.type for f in families.values()} == {"gauge"}
    claims = {
        (s.labels["engine"], s.labels["state"]): s.value
        for s in families["weft_store_claims"].samples
    }
    assert claims == {
        ("dead-engine", "live"): 0,
        ("dead-engine", "expired"): 2,
        ("live-engine", "live"): 1,
        ("live-engine", "expired"): 0,
    }

    def value(name: str) -> float:
        (sample,) = families[name].samples
        return float(sample.value)

    assert value("weft_store_claims_undecodable") == 1
    assert value("weft_store_expired_claims") == 2
    assert 3540 < value("weft_store_oldest_expired_claim_age_seconds") < 3600
    assert value("weft_store_running_workflows") == 4
    assert value("weft_store_running_workflows_without_holder") == 1
    # Engine ids are labels; workflow ids never are.
    assert "wf-" not in out
    # No fresh engine's zero counters: the engines export those themselves.
    assert "weft_workflow_claim_attempts_total" not in out


def test_metrics_escapes_engine_ids_in_labels(storage_url: str) -> None:
    leave_claim(storage_url, "wf-1", offset_ms=HOUR_MS, engine_id='host "a"\\b')

    code, out = run_cli("--url", storage_url, "metrics")

    assert code == 0
    (family,) = [f for f in text_string_to_metric_families(out) if f.name == "weft_store_claims"]
    assert {s.labels["engine"] for s in family.samples} == {'host "a"\\b'}


def test_status_oldest_expiry_is_iso(storage_url: str) -> None:
    leave_claim(storage_url, "wf-1", offset_ms=HOUR_MS, engine_id="e")

    out = run_cli("--url", storage_url, "status")[1]

    assert re.search(rf"oldest expiry\s+{ISO} \(in 60 min\)", out)
