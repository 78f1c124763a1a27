"""The ``weft-sync`` command line on both backends: exit codes, tables, JSON, URLs and signals.

Most tests call :func:`weft_sync.cli.main` in-process with an output buffer; the ``subprocess``
tests run ``python -m weft_sync`` to prove the entry point, and that a user mistake prints one
line and no traceback. Claims are set up through an ``Ownership`` whose ``ManualClock`` sits an
hour before or after the wall clock, so "expired … ago" / "expires in …" is known to the second
although the CLI reads the wall clock.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import cli_handler
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import (
    EngineDeposedError,
    ManualClock,
    Ownership,
    WorkflowClaimLostWarning,
    keys,
    system_clock,
)
from weft_sync.cli import main
from weft_sync.storage import Storage

REPO_ROOT = Path(__file__).resolve().parents[1]
HOUR_MS = 3_600_000
WAIT_S = 20.0
"""Upper bound for waiting on a subprocess; reaching it means the test failed."""


# -- helpers ---------------------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str]:
    """Run the CLI in-process; return its exit code and what it wrote to ``out``."""
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout importable, no inherited store URL."""
    env = {k: v for k, v in os.environ.items() if k != "WEFT_SYNC_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_cli_process(*argv: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m weft_sync ARGV`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "weft_sync", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        check=False,
    )


def assert_one_line_no_traceback(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {stderr!r}"
    assert "Traceback" not in stderr
    assert lines[0].startswith("weft-sync: ")
    for fragment in fragments:
        assert fragment in lines[0]


def leave_claim(
    url: str,
    workflow_id: str,
    *,
    offset_ms: int,
    engine_id: str,
    workflow_type: str = "report",
) -> None:
    """Start a running workflow on an engine whose clock is ``offset_ms`` off, then crash it.

    The engine forgets its claim without releasing it, as a killed process would: the holder
    record stays with ``expires_at`` = wall clock + ``offset_ms`` + the 30 s TTL.
    """
    clock = ManualClock(system_clock() + offset_ms)
    with Ownership.open(url, background="manual", clock=clock, engine_id=engine_id) as engine:
        engine.workflows.start(workflow_id, workflow_type, input={"pages": 3})
        engine.registry.forget_local_claim(workflow_id)


def abandon(url: str, workflow_id: str, workflow_type: str = "report") -> None:
    """A running workflow whose engine died an hour ago (its claim is takeover-eligible)."""
    leave_claim(
        url, workflow_id, offset_ms=-HOUR_MS, engine_id="dead-engine", workflow_type=workflow_type
    )


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite store, for the tests about the entry point rather than the backend."""
    return f"sqlite:///{tmp_path / 'cli.db'}"


@pytest.fixture(autouse=True)
def _fresh_handler_record() -> Iterator[None]:
    cli_handler.take_resumed()
    yield
    cli_handler.take_resumed()


# -- claims ----------------------------------------------------------------------------------


def test_claims_table_shows_holder_epoch_and_signed_expiry(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-dead")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")
    storage.put(keys.workflow_owner_holder("wf-garbled"), b"\xc1 not a holder")

    code, out = run_cli("--url", storage_url, "claims")

    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["WORKFLOW", "HOLDER", "EPOCH", "EXPIRY"]
    by_id = {row.split()[0]: row for row in rows}
    assert set(by_id) == {"wf-dead", "wf-live", "wf-garbled"}
    # An hour back, minus the 30 s TTL, minus the test's own runtime.
    assert re.fullmatch(r"wf-dead\s+dead-engine\s+1\s+expired 35[67]\d\.\ds ago", by_id["wf-dead"])
    assert re.fullmatch(r"wf-live\s+live-engine\s+1\s+expires in 36[23]\d\.\ds", by_id["wf-live"])
    assert re.fullmatch(r"wf-garbled\s+\(undecodable holder\)\s+-\s+-", by_id["wf-garbled"])


def test_claims_json_names_engine_epoch_and_expiry_per_workflow(storage_url: str) -> None:
    abandon(storage_url, "wf-dead")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")

    code, out = run_cli("--url", storage_url, "claims", "--json")

    assert code == 0
    rows = {row["workflow_id"]: row for row in json.loads(out)}
    assert set(rows) == {"wf-dead", "wf-live"}
    dead, live = rows["wf-dead"], rows["wf-live"]
    assert (dead["engine_id"], dead["epoch"], dead["valid"]) == ("dead-engine", 1, True)
    assert (live["engine_id"], live["epoch"], live["valid"]) == ("live-engine", 1, True)
    assert -HOUR_MS + 29_000 - 60_000 < dead["expires_in_ms"] < -HOUR_MS + 30_000
    assert HOUR_MS + 30_000 - 60_000 < live["expires_in_ms"] < HOUR_MS + 30_000
    assert live["expires_at"] - dead["expires_at"] == pytest.approx(2 * HOUR_MS, abs=60_000)


def test_claims_of_an_empty_store_print_only_the_header(storage_url: str) -> None:
    code, out = run_cli("--url", storage_url, "claims")
    assert code == 0
    assert out.split() == ["WORKFLOW", "HOLDER", "EPOCH", "EXPIRY"]
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


def test_workflows_lists_every_record_with_type_and_status(three_workflows: str) -> None:
    code, out = run_cli("--url", three_workflows, "workflows")

    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["WORKFLOW", "TYPE", "STATUS", "UPDATED_AT"]
    assert [row.split()[:3] for row in rows] == [
        ["wf-a", "import", "completed"],
        ["wf-b", "import", "running"],
        ["wf-c", "import", "running"],
    ]


def test_workflows_filters_by_status_and_limit(three_workflows: str) -> None:
    code, out = run_cli("--url", three_workflows, "workflows", "--status", "running", "--json")
    assert code == 0
    records = json.loads(out)
    assert [r["workflow_id"] for r in records] == ["wf-b", "wf-c"]
    assert {r["type"] for r in records} == {"import"}
    assert records[0]["input"] == {"n": 1}
    assert records[0]["created_at"] > 0

    code, out = run_cli("--url", three_workflows, "workflows", "--status", "completed")
    assert code == 0
    assert [row.split()[0] for row in out.splitlines()[1:]] == ["wf-a"]

    code, out = run_cli("--url", three_workflows, "workflows", "--limit", "1", "--json")
    assert code == 0
    assert [r["workflow_id"] for r in json.loads(out)] == ["wf-a"]


def test_workflows_with_an_unknown_status_exit_2_naming_the_valid_ones(
    storage_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli("--url", storage_url, "workflows", "--status", "bogus")

    assert (code, out) == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'bogus'", "running", "completed")


# -- show ------------------------------------------------------------------------------------


def test_show_prints_record_epoch_and_holder(storage_url: str) -> None:
    leave_claim(storage_url, "wf-1", offset_ms=HOUR_MS, engine_id="live-engine")

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["workflow"] == "wf-1"
    assert fields["type"] == "report"
    assert fields["status"] == "running"
    assert fields["epoch"] == "1"
    assert re.fullmatch(r"live-engine \(expires in 36[23]\d\.\ds\)", fields["holder"])


def test_show_json_has_record_epoch_and_holder(storage_url: str) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli("--url", storage_url, "show", "wf-1", "--json")

    assert code == 0
    data = json.loads(out)
    assert data["epoch"] == 1
    assert data["record"]["status"] == "running"
    assert data["record"]["input"] == {"pages": 3}
    assert data["holder"]["engine_id"] == "dead-engine"
    assert data["holder"]["epoch"] == 1
    assert data["holder"]["expires_at"] < system_clock() - HOUR_MS + 30_000 + 1


def test_show_of_a_released_workflow_says_no_holder(storage_url: str) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1")

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    assert "status    completed\n" in out
    assert "holder    (none)\n" in out


def test_show_of_an_unknown_workflow_exits_3(
    storage_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "show", "nope") == (3, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'nope'")


def test_show_of_an_invalid_id_exits_2(
    storage_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "show", "") == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "non-empty")


# -- maintain --once -------------------------------------------------------------------------


def test_maintain_once_without_a_handler_takes_nothing_over(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli("--url", storage_url, "maintain", "--once")

    assert code == 0
    assert out.splitlines() == [
        "renewed 0, failed 0, reclaimed 0 of 1 candidates",
        "no --handler given, so no workflow was taken over",
    ]
    assert stored_epoch(storage, "wf-1") == 1
    assert holder_engine(storage, "wf-1") == "dead-engine"


def test_maintain_once_with_a_handler_reclaims_and_drives_the_abandoned_workflow(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--handler", "tests.cli_handler:resume"
    )

    assert code == 0
    assert out == "renewed 0, failed 0, reclaimed 1 of 1 candidates\n"
    assert cli_handler.take_resumed() == ["wf-1"]
    # Taken over at a new epoch, then released when the command closed its engine.
    assert stored_epoch(storage, "wf-1") == 2
    assert holder_engine(storage, "wf-1") is None


def test_maintain_once_reclaims_only_the_types_named(storage_url: str, storage: Storage) -> None:
    abandon(storage_url, "wf-report", "report")
    abandon(storage_url, "wf-import", "import")

    code, out = run_cli(
        "--url",
        storage_url,
        "maintain",
        "--once",
        "--json",
        "--handler",
        "tests.cli_handler:resume",
        "--type",
        "import",
    )

    assert code == 0
    assert json.loads(out) == {
        "candidates": 2,
        "failed": 0,
        "reclaim_status": "completed",
        "reclaimed": 1,
        "renewed": 0,
    }
    assert cli_handler.take_resumed() == ["wf-import"]
    assert stored_epoch(storage, "wf-import") == 2
    assert (stored_epoch(storage, "wf-report"), holder_engine(storage, "wf-report")) == (
        1,
        "dead-engine",
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tests.cli_handler", "MODULE:FUNCTION"),
        ("tests.no_such_module:resume", "cannot load"),
        ("tests.cli_handler:no_such_function", "cannot load"),
        ("tests.cli_handler:NOT_CALLABLE", "not callable"),
    ],
)
def test_maintain_with_an_unusable_handler_exits_2_before_touching_the_store(
    sqlite_url: str, spec: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_cli("--url", sqlite_url, "maintain", "--once", "--handler", spec)

    assert code == 2
    assert_one_line_no_traceback(capsys.readouterr().err, fragment, repr(spec))
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


def test_maintain_with_unsafe_claim_timing_exits_2(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", sqlite_url, "maintain", "--once", "--claim-ttl", "1s"]
    code, _ = run_cli(*argv, "--renew-interval", "500ms")

    assert code == 2
    assert_one_line_no_traceback(capsys.readouterr().err, "claim_ttl (1000ms)", "at least 1500ms")


def test_maintain_needs_once_or_interval(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", sqlite_url, "maintain") == (2, "")
    assert "one of the arguments --once --interval is required" in capsys.readouterr().err


# -- maintain --interval (a real process and real signals) -----------------------------------


class OutputReader:
    """Reads a child's stdout with a deadline, so a silent child fails the test, not hangs it."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self.text = ""

    def wait_for(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + WAIT_S
        while True:
            match = re.search(pattern, self.text)
            if match is not None:
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {pattern!r} in the output so far: {self.text!r}")
            ready, _, _ = select.select([self._fd], [], [], remaining)
            if ready:
                chunk = os.read(self._fd, 4096)
                if not chunk:
                    raise AssertionError(f"output ended without {pattern!r}: {self.text!r}")
                self.text += chunk.decode()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_maintain_interval_exits_0_and_releases_its_claims_on_a_signal(
    storage_url: str, storage: Storage, signum: signal.Signals
) -> None:
    abandon(storage_url, "wf-1")
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weft_sync",
            "--url",
            storage_url,
            "maintain",
            "--interval",
            "--handler",
            "tests.cli_handler:resume",
            "--claim-ttl",
            "1s",
            "--renew-interval",
            "100ms",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    ) as proc:
        try:
            reader = OutputReader(proc)
            engine_id = reader.wait_for(r"as engine (\S+);")[1]
            reader.wait_for(r"resumed wf-1\n")
            assert holder_engine(storage, "wf-1") == engine_id
            assert stored_epoch(storage, "wf-1") == 2

            proc.send_signal(signum)
            rest, stderr = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rest.decode().endswith("stopping: releasing claims\n")
    assert proc.returncode == 0
    assert stderr.decode() == ""
    assert holder_engine(storage, "wf-1") is None
    assert stored_epoch(storage, "wf-1") == 2


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_prints_every_family_with_its_type_and_the_store_gauges(storage_url: str) -> None:
    abandon(storage_url, "wf-dead")
    leave_claim(storage_url, "wf-live", offset_ms=HOUR_MS, engine_id="live-engine")

    code, out = run_cli("--url", storage_url, "metrics")

    assert code == 0
    for line in (
        "# TYPE weft_workflow_claim_attempts_total counter",
        "# TYPE weft_workflow_claims_active gauge",
        "# TYPE weft_workflow_claim_renewal_failures_total counter",
        "# TYPE weft_store_claims gauge",
        'weft_store_claims{state="live"} 1',
        'weft_store_claims{state="expired_or_invalid"} 1',
    ):
        assert line in out.splitlines()
    families = {f.name: f for f in text_string_to_metric_families(out)}
    assert families["weft_store_claims"].type == "gauge"
    assert {s.labels["state"]: s.value for s in families["weft_store_claims"].samples} == {
        "live": 1.0,
        "expired_or_invalid": 1.0,
    }


def test_metrics_takes_no_claim_over_and_writes_nothing(storage_url: str, storage: Storage) -> None:
    abandon(storage_url, "wf-dead")
    before = dict(storage.scan(""))

    assert run_cli("--url", storage_url, "metrics")[0] == 0

    assert dict(storage.scan("")) == before


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_passes_every_check_on_a_healthy_store(storage_url: str) -> None:
    abandon(storage_url, "wf-1")  # stamps the mode marker

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 0
    lines = out.splitlines()
    assert all(line.startswith("[ok] ") for line in lines[:-1])
    assert "[ok] mode marker: 'workflow-lease'" in lines
    assert "[ok] clock sanity: 0 of 1 claims expire more than a day ahead" in lines
    assert lines[-1] == "no problems found"


def test_doctor_reports_a_corrupt_mode_marker_and_exits_1(
    storage_url: str, storage: Storage
) -> None:
    storage.put(keys.OWNERSHIP_MODE_MARKER, b"\xc1 not a marker")

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 1
    assert "[FAIL] mode marker: present but corrupt; an operator must repair it" in out
    assert out.splitlines()[-1] == "1 problem(s) found"


def test_doctor_reports_claims_expiring_more_than_a_day_ahead(storage_url: str) -> None:
    leave_claim(storage_url, "wf-1", offset_ms=48 * HOUR_MS, engine_id="skewed-engine")

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 1
    assert "[FAIL] clock sanity: 1 of 1 claims expire more than a day ahead" in out


def test_doctor_on_an_unreachable_store_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"

    assert run_cli("--url", url, "doctor") == (1, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "missing-dir")


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_marks_the_workflow_cancelled_and_deposes_its_owner(
    storage_url: str, storage: Storage
) -> None:
    with Ownership.open(storage_url, background="manual") as owner:
        owner.workflows.start("wf-1", "report")
        assert stored_epoch(storage, "wf-1") == 1

        code, out = run_cli("--url", storage_url, "cancel", "wf-1")

        assert (code, out) == (0, "wf-1: cancelled (epoch now 2)\n")
        assert owner.workflows.get("wf-1").status == "cancelled"  # type: ignore[union-attr]
        assert holder_engine(storage, "wf-1") is None
        with pytest.warns(WorkflowClaimLostWarning), pytest.raises(EngineDeposedError):
            owner.workflows.save_checkpoint("wf-1", b"a late step")
    assert storage.get(keys.workflow("wf-1") + ":ckpt") is None


def test_cancel_of_an_unknown_workflow_exits_3(
    storage_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", storage_url, "cancel", "nope") == (3, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "'nope'")


def test_cancel_of_a_finished_workflow_exits_1_and_changes_nothing(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1")
    before = dict(storage.scan(""))

    assert run_cli("--url", storage_url, "cancel", "wf-1") == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "'wf-1'", "completed")
    assert dict(storage.scan("")) == before


# -- where the store comes from --------------------------------------------------------------


def test_store_url_comes_from_weft_sync_url(
    storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    abandon(storage_url, "wf-1")
    monkeypatch.setenv("WEFT_SYNC_URL", storage_url)

    code, out = run_cli("workflows")

    assert code == 0
    assert [row.split()[0] for row in out.splitlines()[1:]] == ["wf-1"]


def test_url_option_wins_over_weft_sync_url(
    storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    abandon(storage_url, "wf-1")
    monkeypatch.setenv("WEFT_SYNC_URL", "bogus://elsewhere")

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    assert "workflow  wf-1\n" in out


def test_default_store_is_weft_sync_db_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEFT_SYNC_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    abandon("sqlite:///weft_sync.db", "wf-1")

    code, out = run_cli("show", "wf-1")

    assert code == 0
    assert "workflow  wf-1\n" in out
    assert (tmp_path / "weft_sync.db").is_file()


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://localhost/0", "scheme must be one of"),
        ("weft_sync.db", "scheme must be one of"),
        ("sqlite:///x.db?table=bad-name", "bad-name"),
    ],
)
def test_a_bad_url_exits_2_with_one_line(
    url: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", url, "claims") == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, fragment)


def test_help_returns_0_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("--help") == (0, "")
    assert "WEFT_SYNC_URL" in capsys.readouterr().out


# -- the entry point, one real process per command family ------------------------------------


def test_entry_point_lists_claims_and_workflows(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    claims = run_cli_process("--url", sqlite_url, "claims", "--json")
    workflows = run_cli_process("--url", sqlite_url, "workflows", "--status", "running")

    assert (claims.returncode, claims.stderr) == (0, "")
    assert [row["workflow_id"] for row in json.loads(claims.stdout)] == ["wf-1"]
    assert (workflows.returncode, workflows.stderr) == (0, "")
    assert workflows.stdout.splitlines()[1].split()[:3] == ["wf-1", "report", "running"]


def test_entry_point_maintain_once_drives_through_the_handler(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    done = run_cli_process(
        "--url", sqlite_url, "maintain", "--once", "--handler", "tests.cli_handler:resume"
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "resumed wf-1",
        "renewed 0, failed 0, reclaimed 1 of 1 candidates",
    ]


def test_entry_point_metrics_and_doctor(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    metrics = run_cli_process("--url", sqlite_url, "metrics")
    doctor = run_cli_process("--url", sqlite_url, "doctor")

    assert (metrics.returncode, metrics.stderr) == (0, "")
    assert "# TYPE weft_store_claims gauge" in metrics.stdout.splitlines()
    assert (doctor.returncode, doctor.stderr) == (0, "")
    assert doctor.stdout.splitlines()[-1] == "no problems found"


def test_entry_point_cancel_then_show(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    cancel = run_cli_process("--url", sqlite_url, "cancel", "wf-1")
    show = run_cli_process("--url", sqlite_url, "show", "wf-1")

    assert (cancel.returncode, cancel.stdout) == (0, "wf-1: cancelled (epoch now 2)\n")
    assert (show.returncode, show.stderr) == (0, "")
    assert "status    cancelled\n" in show.stdout


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["claims"], 2, "scheme must be one of"),
        (["workflows", "--status", "bogus"], 2, "'bogus'"),
        (["show", "nope"], 3, "'nope'"),
        (["maintain", "--once", "--handler", "no_such_module:run"], 2, "cannot load"),
        (["doctor"], 1, "SQLite open failed"),
        (["cancel", "nope"], 3, "'nope'"),
        (["demo", "--workers", "1"], 2, "--workers >= 2"),
    ],
    ids=["claims", "workflows", "show", "maintain", "doctor", "cancel", "demo"],
)
def test_entry_point_reports_a_user_mistake_in_one_line(
    tmp_path: Path, sqlite_url: str, argv: list[str], code: int, fragment: str
) -> None:
    if argv[0] == "claims":
        url = "redis://localhost/0"
    elif argv[0] == "doctor":
        url = f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    else:
        url = sqlite_url

    done = run_cli_process("--url", url, *argv)

    assert (done.returncode, done.stdout) == (code, "")
    assert_one_line_no_traceback(done.stderr, fragment)


@pytest.mark.slow
def test_demo_shows_a_stale_write_refused_by_the_store() -> None:
    done = run_cli_process("demo", "--workers", "2", "--workflows", "4", timeout=90)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused by the store" in done.stdout
    assert "Traceback" not in done.stderr
