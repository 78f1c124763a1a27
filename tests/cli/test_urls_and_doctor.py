"""Where the store URL comes from, that its password is never shown, and ``doctor``'s checks."""

from __future__ import annotations

import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.helpers import (
    HOUR_MS,
    WAIT_S,
    OutputReader,
    abandon,
    assert_one_line_no_traceback,
    cli_command,
    cli_env,
    leave_claim,
    run_cli,
)
from weft_sync import keys
from weft_sync.storage import Storage, open_storage

SECRET = "s3cret-Pa55"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


# -- --url anywhere, and where the URL came from ----------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_url_is_accepted_before_or_after_the_command(
    storage_url: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    abandon(storage_url, "wf-1")
    monkeypatch.setenv("WEFT_SYNC_URL", "bogus://elsewhere")
    argv = ["--url", storage_url, "show", "wf-1"]
    if where == "after":
        argv = ["show", "wf-1", "--url", storage_url]

    code, out = run_cli(*argv)

    assert code == 0
    assert "workflow    wf-1\n" in out


def test_store_url_comes_from_weft_sync_url(
    storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    abandon(storage_url, "wf-1")
    monkeypatch.setenv("WEFT_SYNC_URL", storage_url)

    code, out = run_cli("workflows")

    assert code == 0
    assert [row.split()[0] for row in out.splitlines()[1:]] == ["wf-1"]


def test_default_store_is_weft_sync_db_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEFT_SYNC_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    abandon("sqlite:///weft_sync.db", "wf-1")

    code, out = run_cli("show", "wf-1")

    assert code == 0
    assert "workflow    wf-1\n" in out


def test_a_missing_default_store_names_the_default_as_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WEFT_SYNC_URL", raising=False)
    monkeypatch.chdir(tmp_path)

    assert run_cli("claims") == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "weft_sync.db", "the default URL")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://localhost/0", "scheme must be one of"),
        ("weft_sync.db", "scheme must be one of"),
        ("sqlite:///x.db?table=bad-name", "bad-name"),
    ],
)
@pytest.mark.parametrize("source", ["--url", "$WEFT_SYNC_URL"])
def test_a_bad_url_exits_2_naming_its_source(
    url: str,
    fragment: str,
    source: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if source == "--url":
        argv = ["--url", url, "claims"]
    else:
        monkeypatch.setenv("WEFT_SYNC_URL", url)
        argv = ["claims"]

    assert run_cli(*argv) == (2, "")

    assert_one_line_no_traceback(capsys.readouterr().err, f"bad store URL from {source}", fragment)


def test_help_returns_0_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("--help") == (0, "")
    assert "WEFT_SYNC_URL" in capsys.readouterr().out


# -- credentials are never printed -----------------------------------------------------------


def test_a_url_parameter_error_masks_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"postgresql://app:{SECRET}@127.0.0.1:1/main?min_size=lots"

    assert run_cli("--url", url, "claims") == (2, "")

    err = capsys.readouterr().err
    assert SECRET not in err
    assert_one_line_no_traceback(err, "postgresql://app:***@127.0.0.1:1/main", "min_size")


def test_a_connection_failure_masks_the_password(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"postgresql://app:{SECRET}@127.0.0.1:{closed_port}/main?password={SECRET}&timeout=1"

    assert run_cli("--url", url, "workflows") == (1, "")

    err = capsys.readouterr().err
    assert SECRET not in err
    assert_one_line_no_traceback(err, "--url", "postgresql://app:***@127.0.0.1")


def test_doctor_masks_the_password_in_every_line(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"postgresql://app:{SECRET}@127.0.0.1:{closed_port}/main?timeout=1"

    code, out = run_cli("--url", url, "doctor")

    assert code == 1
    assert SECRET not in out + capsys.readouterr().err
    assert out.splitlines()[0] == (
        f"checking postgresql://app:***@127.0.0.1:{closed_port}/main?timeout=1 (read-only)"
    )
    assert out.splitlines()[1].startswith("[FAIL] open the store: ")
    assert out.splitlines()[-1] == "1 problem(s) found"


def with_password(postgres_base_url: str) -> str:
    """A URL of a fresh table on the test server, carrying a password in both places a URL
    can (the server trusts local connections, so it ignores the password)."""
    url = postgres_base_url.replace("postgresql://postgres@", f"postgresql://postgres:{SECRET}@")
    assert SECRET in url, "the test server URL has an unexpected shape"
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}password={SECRET}&table=t_{uuid.uuid4().hex[:16]}"


def test_doctor_on_a_reachable_postgres_masks_the_password(postgres_base_url: str) -> None:
    url = with_password(postgres_base_url)
    open_storage(url).close()

    code, out = run_cli("--url", url, "doctor")

    assert code == 0, out
    assert SECRET not in out
    assert out.splitlines()[0].startswith("checking postgresql://postgres:***@/postgres?")
    assert "password=***" in out.splitlines()[0]


@pytest.mark.slow
def test_the_maintain_interval_banner_masks_the_password(postgres_base_url: str) -> None:
    url = with_password(postgres_base_url)
    open_storage(url).close()
    with subprocess.Popen(
        cli_command("maintain", "--interval", "--url", url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    ) as proc:
        try:
            banner = OutputReader(proc).wait_for(r"maintaining .* Ctrl-C or SIGTERM stops\n")[0]
            proc.send_signal(signal.SIGTERM)
            rest, stderr = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
    assert SECRET not in banner + rest.decode() + stderr.decode()
    assert banner.startswith("maintaining postgresql://postgres:***@/postgres?")


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_passes_every_check_on_a_healthy_store_and_says_what_it_checked(
    storage_url: str,
) -> None:
    abandon(storage_url, "wf-1")  # stamps the mode marker

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("checking ")
    assert lines[-1] == "no problems found"
    checks = lines[1:-1]
    assert all(line.startswith(("[ok] ", "[info] ")) for line in checks), checks
    assert "[ok] open the store: the file or table exists and answers reads" in checks
    assert "[ok] mode marker: 'workflow-lease'" in checks
    assert "[ok] clock sanity: 0 of 1 claims expire more than a day ahead" in checks
    skipped = "compare-and-swap probe skipped: it writes; 'weft-sync doctor --fix' runs it"
    assert f"[info] {skipped}" in checks
    assert "[info] expired claims awaiting takeover: 1" in checks


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


def test_doctor_reports_undecodable_holder_records(storage_url: str, storage: Storage) -> None:
    storage.put(keys.workflow_owner_holder("wf-x"), b"\xc1")

    code, out = run_cli("--url", storage_url, "doctor")

    assert code == 1
    assert "[FAIL] holder records: 1 do not decode" in out


# -- a defect still prints one line ----------------------------------------------------------


def test_an_unexpected_error_prints_one_line_unless_debugging(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from weft_sync.cli import commands as cli_commands

    def broken(*args: object) -> int:
        raise RuntimeError("a defect at postgresql://app:s3cret@db/main")

    monkeypatch.setattr(cli_commands, "claims", broken)
    monkeypatch.delenv("WEFT_SYNC_DEBUG", raising=False)

    assert run_cli("--url", sqlite_url, "claims") == (1, "")
    err = capsys.readouterr().err
    assert_one_line_no_traceback(
        err, "unexpected error: RuntimeError: a defect", "WEFT_SYNC_DEBUG=1"
    )
    assert "s3cret" not in err

    monkeypatch.setenv("WEFT_SYNC_DEBUG", "1")
    assert run_cli("--url", sqlite_url, "claims") == (1, "")
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert "RuntimeError: a defect at postgresql://app:" in err and "in broken" in err
    assert "s3cret" not in err
