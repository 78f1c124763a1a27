"""A bad option value is a usage error (exit 2, one line naming the option and the value).

It is checked before the store opens, so it wins over what the store would have said: a
missing store (exit 1), a workflow without an epoch key (exit 3) or one whose epoch is not
corrupt (exit 1). Nothing is created or changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import assert_one_line_no_traceback, run_cli, run_cli_process
from weft_sync import Ownership, keys


def _started(url: str) -> bytes | None:
    """A store with workflow ``wf-1`` started; its (valid) epoch key."""
    with Ownership.open(url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
        return engine.storage.get(keys.workflow_owner_epoch("wf-1"))


@pytest.mark.parametrize("at_least", ["-5", "0", "9007199254740990"])
def test_repair_epoch_with_a_bad_at_least_exits_2_and_changes_nothing(
    sqlite_url: str, at_least: str
) -> None:
    epoch = _started(sqlite_url)

    done = run_cli_process("--url", sqlite_url, "repair-epoch", "wf-1", f"--at-least={at_least}")

    assert (done.returncode, done.stdout) == (2, "")
    assert_one_line_no_traceback(done.stderr, "--at-least", at_least)
    with Ownership.open(sqlite_url, background="manual") as engine:
        assert engine.storage.get(keys.workflow_owner_epoch("wf-1")) == epoch


@pytest.mark.parametrize("store", ["empty", "missing"])
def test_repair_epoch_bad_at_least_wins_over_what_the_store_says(
    sqlite_url: str, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if store == "empty":
        Ownership.open(sqlite_url, background="manual").close()

    code, out = run_cli("--url", sqlite_url, "repair-epoch", "wf-x", "--at-least", "-5")

    assert (code, out) == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "--at-least", "-5")
    assert Path(sqlite_url.removeprefix("sqlite:///")).exists() is (store == "empty")


def test_workflows_with_a_bad_status_exits_2_before_opening_the_store(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli("--url", sqlite_url, "workflows", "--status", "bogus")

    assert (code, out) == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, "--status", "'bogus'")
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize("option", ["--claim-ttl", "--renew-interval"])
@pytest.mark.parametrize("value", ["abc", "-5s", "30"])
def test_maintain_with_a_bad_duration_names_the_option(
    sqlite_url: str, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli("--url", sqlite_url, "maintain", "--once", f"{option}={value}")

    assert (code, out) == (2, "")
    assert_one_line_no_traceback(capsys.readouterr().err, option, repr(value))
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()
