"""``maintain`` on both backends: handlers get a ``ReclaimedWorkflow``, failures exit 1."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cli import handler
from tests.cli.helpers import (
    WAIT_S,
    OutputReader,
    abandon,
    assert_one_line_no_traceback,
    cli_command,
    cli_env,
    run_cli,
    run_cli_process,
)
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import Ownership, keys
from weft_sync.cli.commands import StoreRef
from weft_sync.errors import StorageError
from weft_sync.storage import Storage

# The one kind of stderr line a loaded machine may add at a 100 ms interval: a sub-pass that
# overran its tick. Anything else on stderr (an error, a lost claim, a traceback) fails.
_OVERRUN = re.compile(
    r"weft-sync: warning: weft_sync: the [a-z_-]+ sub-pass is still running after one interval "
    r"\(\d+ ms\); skipping it this tick"
)


EXIT_GUARD_S = 90.0
"""A hang guard for the exit after a signal: on a machine at load 20 the pass in flight and the
releases on PostgreSQL took more than 20 s."""


def _assert_only_overrun_warnings(stderr: str) -> None:
    unexpected = [line for line in stderr.splitlines() if not _OVERRUN.fullmatch(line)]
    assert unexpected == [], stderr


def test_maintain_once_without_a_handler_takes_nothing_over(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli("--url", storage_url, "maintain", "--once")

    assert code == 0
    assert out.splitlines() == [
        "renewed 0, failed 0; 1 reclaim candidates: "
        "reclaimed 0, not-eligible 1, backoff-skipped 0, lost-race 0, error 0",
        "no --handler given, so no workflow was taken over",
    ]
    assert stored_epoch(storage, "wf-1") == 1
    assert holder_engine(storage, "wf-1") == "dead-engine"


def test_maintain_once_hands_the_handler_a_reclaimed_workflow_it_writes_through(
    storage_url: str, storage: Storage
) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--handler", "tests.cli.handler:finish"
    )

    assert code == 0, out
    assert out == (
        "renewed 0, failed 0; 1 reclaim candidates: "
        "reclaimed 1, not-eligible 0, backoff-skipped 0, lost-race 0, error 0\n"
    )
    assert handler.take_resumed() == [("wf-1", "report", 2)]
    # The handler's fenced checkpoint write and its complete() both landed: it wrote as the
    # new owner at epoch 2, and was not deposed.
    assert storage.get(keys.workflow("wf-1") + ":ckpt") == handler.CHECKPOINT
    with Ownership.open(storage_url, background="manual") as reader:
        record = reader.workflows.get("wf-1")
        outcome = reader.workflows.get_outcome("wf-1")
    assert record is not None and record.status == "completed"
    assert outcome is not None and outcome.result == {"resumed_at_epoch": 2}
    assert stored_epoch(storage, "wf-1") == 2
    assert holder_engine(storage, "wf-1") is None


def test_maintain_once_drives_only_the_types_named(storage_url: str, storage: Storage) -> None:
    abandon(storage_url, "wf-report", "report")
    abandon(storage_url, "wf-import", "import")

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--json",
        "--handler", "tests.cli.handler:resume", "--type", "import",
    )  # fmt: skip

    assert code == 0
    summary = json.loads(out)
    assert summary["candidates"] == 2
    assert summary["reclaimed"] == 1
    assert summary["outcomes"] == {
        "reclaimed": 1,
        "not-eligible": 1,
        "backoff-skipped": 0,
        "lost-race": 0,
        "error": 0,
    }
    assert summary["ok"] is True
    assert handler.take_resumed() == [("wf-import", "import", 2)]
    assert storage.get(keys.workflow("wf-import") + ":ckpt") == handler.CHECKPOINT
    assert (stored_epoch(storage, "wf-report"), holder_engine(storage, "wf-report")) == (
        1,
        "dead-engine",
    )


def test_maintain_once_exits_1_and_names_each_failed_candidate(
    storage_url: str, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    abandon(storage_url, "wf-1")
    abandon(storage_url, "wf-2")

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--handler", "tests.cli.handler:explode"
    )

    assert code == 1
    lines = out.splitlines()
    assert lines[0] == (
        "renewed 0, failed 0; 2 reclaim candidates: "
        "reclaimed 0, not-eligible 0, backoff-skipped 0, lost-race 0, error 2"
    )
    assert sorted(lines[1:3]) == [
        "error on wf-1: cannot drive wf-1 at postgresql://app:***@db/main",
        "error on wf-2: cannot drive wf-2 at postgresql://app:***@db/main",
    ]
    assert lines[3] == "maintenance pass FAILED"
    assert "s3cret" not in out


def test_maintain_once_json_reports_errors_and_not_ok(storage_url: str, storage: Storage) -> None:
    abandon(storage_url, "wf-1")

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--json",
        "--handler", "tests.cli.handler:explode",
    )  # fmt: skip

    assert code == 1
    summary = json.loads(out)
    assert summary["ok"] is False
    assert summary["outcomes"]["error"] == 1
    assert summary["errors"] == {"wf-1": "cannot drive wf-1 at postgresql://app:***@db/main"}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tests.cli.handler", "MODULE:FUNCTION"),
        ("tests.no_such_module:resume", "cannot load"),
        ("tests.cli.handler:no_such_function", "cannot load"),
        ("tests.cli.handler:NOT_CALLABLE", "not callable"),
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


def test_entry_point_maintain_once_drives_through_the_handler(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    done = run_cli_process(
        "--url", sqlite_url, "maintain", "--once", "--handler", "tests.cli.handler:resume"
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "resumed wf-1",
        "renewed 0, failed 0; 1 reclaim candidates: "
        "reclaimed 1, not-eligible 0, backoff-skipped 0, lost-race 0, error 0",
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_maintain_interval_exits_0_and_releases_its_claims_on_a_signal(
    storage_url: str, storage: Storage, signum: signal.Signals
) -> None:
    abandon(storage_url, "wf-1")
    # The handler drives until the engine closes: a handler that returned would hand its claim
    # on, and it would be released (with a warning) one renew interval later.
    argv = cli_command(
        "maintain", "--interval", "--handler", "tests.cli.handler:resume_until_closed",
        "--claim-ttl", "1s", "--renew-interval", "100ms", "--url", storage_url,
    )  # fmt: skip
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env()
    ) as proc:
        try:
            reader = OutputReader(proc)
            banner = reader.wait_for(r"maintaining (\S+) as engine (\S+);")
            reader.wait_for(r"resumed wf-1\n")
            assert holder_engine(storage, "wf-1") == banner[2]
            assert stored_epoch(storage, "wf-1") == 2

            proc.send_signal(signum)
            rest, stderr = proc.communicate(timeout=EXIT_GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rest.decode().endswith("stopping: releasing claims\n")
    assert proc.returncode == 0
    _assert_only_overrun_warnings(stderr.decode())
    assert storage.get(keys.workflow("wf-1") + ":ckpt") == handler.CHECKPOINT
    assert holder_engine(storage, "wf-1") is None
    assert stored_epoch(storage, "wf-1") == 2


def test_a_handler_module_failing_at_import_exits_2_naming_the_error(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "tests.cli.broken_handlers:resume"

    assert run_cli("--url", sqlite_url, "maintain", "--once", "--handler", spec)[0] == 2

    assert_one_line_no_traceback(
        capsys.readouterr().err, "cannot load", "RuntimeError", "setting that is missing"
    )


class _ScanFails:
    """A real store whose scans fail: the reclaim pass cannot list its candidates."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def scan(self, *args: object, **kwargs: object) -> list[tuple[str, bytes]]:
        raise StorageError("scan failed on postgresql://app:s3cret@db/main")

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __enter__(self) -> _ScanFails:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._inner.close()


def test_maintain_once_exits_1_when_reclaim_discovery_fails(
    storage_url: str, storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    abandon(storage_url, "wf-1")
    real_open = StoreRef.open
    monkeypatch.setattr(
        StoreRef,
        "open",
        lambda self, *, read_only: _ScanFails(real_open(self, read_only=read_only)),
    )

    code, out = run_cli(
        "--url", storage_url, "maintain", "--once", "--handler", "tests.cli.handler:resume"
    )

    assert code == 1
    assert "reclaim discovery failed: scan failed on postgresql://app:***@db/main\n" in out
    assert out.endswith("maintenance pass FAILED\n")
    assert "s3cret" not in out
    assert holder_engine(storage, "wf-1") == "dead-engine"


def test_maintain_type_without_a_handler_exits_2(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--url", sqlite_url, "maintain", "--once", "--type", "report") == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "--type", "--handler")


@pytest.mark.slow
def test_maintain_interval_shows_a_failing_handler_on_stderr_in_one_line(
    sqlite_url: str,
) -> None:
    abandon(sqlite_url, "wf-1")
    argv = cli_command(
        "maintain", "--interval", "--handler", "tests.cli.handler:explode",
        "--claim-ttl", "1s", "--renew-interval", "100ms", "--url", sqlite_url,
    )  # fmt: skip
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env()
    ) as proc:
        try:
            line = OutputReader(proc, stderr=True).wait_for(r"weft-sync: error: .*\n")[0]
            proc.send_signal(signal.SIGTERM)
            out, rest = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
    assert line == (
        "weft-sync: error: handler for workflow type 'report' raised on workflow 'wf-1' "
        "(epoch 2); its claim is released for a redrive "
        "(RuntimeError: cannot drive wf-1 at postgresql://app:***@db/main)\n"
    )
    assert "Traceback" not in rest.decode()
    assert "s3cret" not in line + rest.decode() + out.decode()
