"""``python -m weft_sync`` as a real process: closed pipes, Ctrl-C, user mistakes, the demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cli.helpers import (
    WAIT_S,
    OutputReader,
    abandon,
    assert_one_line_no_traceback,
    cli_command,
    cli_env,
    run_cli_process,
)
from weft_sync import Ownership, keys, system_clock
from weft_sync.codec import HolderRecord, WorkflowRecord, encode_holder, encode_workflow_record
from weft_sync.storage import Put, open_storage


def test_entry_point_lists_claims_and_workflows(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    claims = run_cli_process("--url", sqlite_url, "claims", "--json")
    workflows = run_cli_process("workflows", "--status", "running", "--url", sqlite_url)

    assert (claims.returncode, claims.stderr) == (0, "")
    assert [row["workflow_id"] for row in json.loads(claims.stdout)] == ["wf-1"]
    assert (workflows.returncode, workflows.stderr) == (0, "")
    assert workflows.stdout.splitlines()[1].split()[:3] == ["wf-1", "report", "running"]


def test_entry_point_status_metrics_doctor_and_show(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")

    for argv, expected in [
        (["status"], "running workflows       1"),
        (["metrics"], "# TYPE weft_store_claims gauge"),
        (["doctor"], "no problems found"),
        (["show", "wf-1"], "status      running"),
    ]:
        done = run_cli_process("--url", sqlite_url, *argv)
        assert (done.returncode, done.stderr) == (0, ""), argv
        assert expected in done.stdout.splitlines(), (argv, done.stdout)


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["claims"], 2, "scheme must be one of"),
        (["workflows", "--status", "bogus"], 2, "'bogus'"),
        (["show", "nope"], 3, "'nope'"),
        (["maintain", "--once", "--handler", "no_such_module:run"], 2, "cannot load"),
        (["status"], 1, "does not exist"),
        (["cancel", "nope"], 3, "'nope'"),
        (["release", "nope"], 3, "no claim on 'nope'"),
        (["demo", "--workers", "1"], 2, "--workers >= 2"),
    ],
    ids=["claims", "workflows", "show", "maintain", "status", "cancel", "release", "demo"],
)
def test_entry_point_reports_a_user_mistake_in_one_line(
    tmp_path: Path, sqlite_url: str, argv: list[str], code: int, fragment: str
) -> None:
    if argv[0] == "claims":
        url = "redis://localhost/0"
    elif argv[0] == "status":
        url = f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    else:
        url = sqlite_url
        Ownership.open(url, background="manual").close()  # an empty store

    # The demo runs on a store of its own and refuses --url (tested on its own).
    done = run_cli_process(*argv) if argv[0] == "demo" else run_cli_process("--url", url, *argv)

    assert (done.returncode, done.stdout) == (code, "")
    assert_one_line_no_traceback(done.stderr, fragment)


def _fill(url: str) -> None:
    """Far more output than a pipe buffers (64 KiB) from each listing: 4,000 running workflows
    with long ids, 1,500 of them with a holder."""
    now = system_clock()
    operations: list[Put] = []
    for n in range(4000):
        wid = f"a-workflow-with-a-rather-long-identifier-{n:05d}"
        record = WorkflowRecord(wid, "report", "running", created_at=now, updated_at=now)
        operations.append(Put(keys.workflow(wid), encode_workflow_record(record)))
        operations.append(Put(keys.workflow_status_index("running", wid), b""))
        if n < 1500:
            holder = HolderRecord("engine-1", 1, now + 60_000, now)
            operations.append(Put(keys.workflow_owner_holder(wid), encode_holder(holder)))
    with open_storage(url) as storage:
        storage.batch(operations)


@pytest.mark.parametrize(
    "argv", [["claims", "--json"], ["workflows"], ["status", "--json"]], ids=lambda a: a[0]
)
def test_a_closed_output_pipe_ends_quietly(sqlite_url: str, argv: list[str]) -> None:
    _fill(sqlite_url)
    # ``| head -1``: the reader takes one line and closes its end.
    with subprocess.Popen(
        cli_command("--url", sqlite_url, *argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.wait(timeout=WAIT_S)

    assert first.strip()
    assert stderr.decode() == ""
    assert proc.returncode == 0


def test_the_pipe_test_store_overflows_a_pipe(sqlite_url: str) -> None:
    # What makes the test above meaningful: every listing is larger than a pipe buffer.
    _fill(sqlite_url)
    for argv in (["claims", "--json"], ["workflows"], ["status", "--json"]):
        done = run_cli_process("--url", sqlite_url, *argv)
        assert done.returncode == 0
        assert len(done.stdout) > 2 * 65536, argv


def _interrupt_demo(after: str, extra: list[str]) -> tuple[int, str, str]:
    """Run the demo in its own process group and Ctrl-C it (SIGINT to the group) after a line."""
    with subprocess.Popen(
        cli_command("demo", "--workers", "2", "--workflows", "4", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        start_new_session=True,
    ) as proc:
        try:
            reader = OutputReader(proc)
            reader.wait_for(after)
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            rest, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, reader.text + rest.decode(), stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize(
    "after",
    [r"2\. Starting", r"started payout-0\d: claimed", r"3\. Renewals keep"],
    ids=["starting", "claimed", "killing"],
)
def test_ctrl_c_stops_the_demo_without_a_traceback(after: str) -> None:
    code, out, stderr = _interrupt_demo(after, [])

    assert code == 130, out + stderr
    assert "Traceback" not in out + stderr
    assert stderr == "weft-sync: interrupted\n"


@pytest.mark.slow
def test_demo_keep_dir_keeps_a_store_the_cli_can_read(tmp_path: Path) -> None:
    keep = tmp_path / "kept"

    done = run_cli_process(
        "demo", "--workers", "2", "--workflows", "4", "--keep", str(keep), timeout=90
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused by the store" in done.stdout
    assert "Traceback" not in done.stderr
    url = f"sqlite:///{keep / 'demo.db'}"
    assert f"The store is kept: weft-sync --url {url} status" in done.stdout
    listing = run_cli_process("--url", url, "workflows", "--json")
    assert listing.returncode == 0, listing.stderr
    assert sorted(r["workflow_id"] for r in json.loads(listing.stdout)) == [
        f"payout-0{n}" for n in range(4)
    ]

    again = run_cli_process("demo", "--keep", str(keep))
    assert again.returncode == 2
    assert_one_line_no_traceback(again.stderr, "already holds a demo.db")


def test_ctrl_c_during_a_maintenance_pass_ends_quietly(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")
    with subprocess.Popen(
        cli_command(
            "--url", sqlite_url, "maintain", "--once", "--handler", "tests.cli.handler:stall"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    ) as proc:
        try:
            OutputReader(proc).wait_for(r"stalling wf-1\n")
            proc.send_signal(signal.SIGINT)
            out, stderr = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()

    assert proc.returncode == 130
    assert stderr.decode() == "weft-sync: interrupted\n"
    assert "Traceback" not in out.decode()
