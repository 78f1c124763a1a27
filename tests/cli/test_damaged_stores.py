"""The command line on stores that are partly broken or out of reach, and on bad URLs.

- A row that does not decode, or that the store cannot return at all (a foreign writer's
  ``INTEGER`` where bytes belong), is marked in ``claims`` and ``workflows`` and named on
  stderr, and ``show`` names its key and what is wrong; every other row is still listed, the
  exit code stays 0, and nothing is written.
- ``maintain --once`` reports a handler that raised in one line per record, drives the other
  candidates, and exits 1; ``WEFT_SYNC_DEBUG=1`` adds the traceback.
- A bad port or ``sslmode`` in a PostgreSQL URL is a usage error (exit 2) naming the value.
- A SQLite file behind a directory the process may not search is reported as permission
  denied; ``doctor`` suggests ``--fix`` only where creating the store is the fix.
- A PostgreSQL server that accepts no connection is reported as out of reach.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.cli.helpers import (
    HOUR_MS,
    WAIT_S,
    abandon,
    assert_one_line_no_traceback,
    cli_command,
    cli_env,
    leave_claim,
    run_cli,
    run_cli_process,
)
from tests.pgcluster import PostgresCluster
from tests.workflows.helpers import holder_engine
from weft_sync import Ownership, keys
from weft_sync.cli.commands.rows import SCAN_PAGE, Unreadable, read_value, scan_rows
from weft_sync.codec import HolderRecord, encode_holder
from weft_sync.errors import StorageError
from weft_sync.storage import Put, Storage, open_storage

# Values a foreign writer may leave in the value column: bytes that are not MessagePack, and
# SQLite values that are not bytes at all (the backend refuses to return the last two).
BAD_VALUES = [b"\xc1", "text", 42, 4.5]
BAD_IDS = ["bad-msgpack", "text", "integer", "real"]

# -- helpers ---------------------------------------------------------------------------------------


def _path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///").partition("?")[0])


def _overwrite(url: str, key: str, value: object) -> None:
    """Store ``value`` at ``key`` through a second, plain sqlite3 connection to the file."""
    conn = sqlite3.connect(_path(url))
    try:
        with conn:
            changed = conn.execute("UPDATE weft_kv SET value = ? WHERE key = ?", (value, key))
            assert changed.rowcount == 1, key
    finally:
        conn.close()


def _dump(url: str) -> list[tuple[str, str, object]]:
    """Every row of the store's table with the SQLite type of its value, in key order."""
    conn = sqlite3.connect(_path(url))
    try:
        return conn.execute("SELECT key, typeof(value), value FROM weft_kv ORDER BY key").fetchall()
    finally:
        conn.close()


@pytest.fixture
def three_claims(sqlite_url: str) -> str:
    """Running workflows wf-a, wf-b and wf-c, each held by a live engine; returns the URL."""
    for workflow_id in ("wf-a", "wf-b", "wf-c"):
        leave_claim(sqlite_url, workflow_id, offset_ms=HOUR_MS, engine_id="live-engine")
    return sqlite_url


def _warnings(stderr: str) -> list[str]:
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert all(line.startswith("weft-sync: warning: ") for line in lines), stderr
    return lines


# -- one bad row does not hide the others ----------------------------------------------------------


@pytest.mark.parametrize("value", BAD_VALUES, ids=BAD_IDS)
def test_claims_lists_every_other_claim_and_names_the_bad_holder_row(
    three_claims: str, value: object
) -> None:
    _overwrite(three_claims, keys.workflow_owner_holder("wf-b"), value)
    before = _dump(three_claims)

    done = run_cli_process("--url", three_claims, "claims")

    assert done.returncode == 0, done.stderr
    _, *rows = done.stdout.splitlines()
    by_id = {row.split()[0]: row for row in rows}
    assert list(by_id) == ["wf-a", "wf-b", "wf-c"]
    assert re.fullmatch(r"wf-b\s+\(undecodable holder\)\s+-\s+-\s+-\s+-", by_id["wf-b"])
    for live in ("wf-a", "wf-c"):
        assert re.match(rf"{live}\s+live-engine\s+1\s+live\s", by_id[live]), by_id[live]
    [warning] = _warnings(done.stderr)
    assert "'wf-owner-holder:wf-b'" in warning
    assert warning.endswith("; listed as undecodable")
    assert _dump(three_claims) == before


def test_claims_json_says_what_is_wrong_with_a_row_the_store_cannot_return(
    three_claims: str,
) -> None:
    _overwrite(three_claims, keys.workflow_owner_holder("wf-b"), 42)

    done = run_cli_process("--url", three_claims, "claims", "--json")

    assert done.returncode == 0, done.stderr
    rows = {row["workflow_id"]: row for row in json.loads(done.stdout)}
    assert (rows["wf-a"]["valid"], rows["wf-a"]["problem"]) == (True, None)
    assert rows["wf-b"]["valid"] is False
    assert rows["wf-b"]["problem"] == (
        "'wf-owner-holder:wf-b' cannot be read: stored value of type int is not a BLOB: 42"
    )
    assert rows["wf-c"]["engine_id"] == "live-engine"


@pytest.mark.parametrize("value", BAD_VALUES, ids=BAD_IDS)
@pytest.mark.parametrize("status", [None, "running"], ids=["all", "by-status"])
def test_workflows_lists_every_other_record_and_marks_the_bad_one_undecodable(
    three_claims: str, value: object, status: str | None
) -> None:
    _overwrite(three_claims, keys.workflow("wf-b"), value)
    before = _dump(three_claims)
    argv = ["--url", three_claims, "workflows"] + (["--status", status] if status else [])

    done = run_cli_process(*argv)

    assert done.returncode == 0, done.stderr
    _, *rows = done.stdout.splitlines()
    assert [row.split()[:3] for row in rows] == [
        ["wf-a", "report", "running"],
        ["wf-b", "-", "undecodable"],
        ["wf-c", "report", "running"],
    ]
    [warning] = _warnings(done.stderr)
    assert "'wf:wf-b'" in warning
    assert _dump(three_claims) == before


def test_workflows_json_marks_the_bad_record_and_counts_it_in_the_limit(
    three_claims: str,
) -> None:
    _overwrite(three_claims, keys.workflow("wf-a"), 42)

    done = run_cli_process("--url", three_claims, "workflows", "--json", "--limit", "2")

    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)
    assert (first["workflow_id"], first["status"], first["type"]) == ("wf-a", "undecodable", None)
    assert first["problem"] == (
        "'wf:wf-a' cannot be read: stored value of type int is not a BLOB: 42"
    )
    assert (second["workflow_id"], second["status"], second["problem"]) == (
        "wf-b",
        "running",
        None,
    )


def test_workflows_on_both_backends_marks_a_record_that_is_not_messagepack(
    storage_url: str, storage: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        for workflow_id in ("wf-a", "wf-b"):
            engine.workflows.start(workflow_id, "import")
    storage.put(keys.workflow("wf-a"), b"\xc1 not a record")
    before = dict(storage.scan(""))

    code, out = run_cli("--url", storage_url, "workflows")

    assert code == 0
    assert [row.split()[:3] for row in out.splitlines()[1:]] == [
        ["wf-a", "-", "undecodable"],
        ["wf-b", "import", "running"],
    ]
    [warning] = _warnings(capsys.readouterr().err)
    assert "'wf:wf-a' holds 14 bytes, not a valid workflow record" in warning
    assert dict(storage.scan("")) == before


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"\xc1", "'wf:wf-b' holds 1 byte, not a valid workflow record"),
        (42, "'wf:wf-b' cannot be read: stored value of type int is not a BLOB: 42"),
    ],
    ids=["bad-msgpack", "integer"],
)
def test_show_of_a_bad_record_names_its_key_and_what_is_wrong(
    three_claims: str, value: object, problem: str
) -> None:
    _overwrite(three_claims, keys.workflow("wf-b"), value)
    before = _dump(three_claims)

    done = run_cli_process("--url", three_claims, "show", "wf-b")

    assert (done.returncode, done.stderr) == (0, "")
    fields = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert fields["record"] == f"({problem})"
    assert fields["holder"] == "live-engine at epoch 1"  # the rest of the workflow still shows
    assert fields["epoch"] == "1"
    data = json.loads(run_cli_process("--url", three_claims, "show", "wf-b", "--json").stdout)
    assert (data["record"], data["record_valid"]) == (None, False)
    assert data["problems"] == {"wf:wf-b": problem}
    assert _dump(three_claims) == before


def test_show_of_an_unreadable_holder_names_its_key(three_claims: str) -> None:
    _overwrite(three_claims, keys.workflow_owner_holder("wf-b"), 4.5)

    done = run_cli_process("--url", three_claims, "show", "wf-b")

    assert done.returncode == 0, done.stderr
    fields = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert fields["holder"] == (
        "('wf-owner-holder:wf-b' cannot be read: stored value of type float is not a BLOB: 4.5)"
    )
    assert fields["status"] == "running"


def test_status_and_doctor_count_a_holder_row_the_store_cannot_return(three_claims: str) -> None:
    _overwrite(three_claims, keys.workflow_owner_holder("wf-b"), 42)

    status = run_cli_process("--url", three_claims, "status", "--json")
    doctor = run_cli_process("--url", three_claims, "doctor")

    assert status.returncode == 0, status.stderr
    claims = json.loads(status.stdout)["claims"]
    assert claims == {"total": 3, "live": 2, "expired": 0, "undecodable": 1}
    assert doctor.returncode == 1, doctor.stderr
    assert "[FAIL] holder records: 1 do not decode" in doctor.stdout.splitlines()


def test_doctor_names_an_epoch_key_the_store_cannot_return(three_claims: str) -> None:
    _overwrite(three_claims, keys.workflow_owner_epoch("wf-b"), 42)

    done = run_cli_process("--url", three_claims, "doctor")

    assert (done.returncode, done.stderr) == (1, "")
    assert "[FAIL] epoch keys: 1 do not decode" in done.stdout
    assert "'wf-owner-epoch:wf-b': stored value of type int is not a BLOB: 42" in done.stdout


def test_scan_rows_reads_past_unreadable_rows_on_any_page(sqlite_url: str) -> None:
    """More rows than a page, unreadable ones first, adjacent, on a page boundary, last, and
    under a key outside ASCII: every row comes back in key order, the bad ones named."""
    holder = encode_holder(HolderRecord("engine", 1, 2, 1))
    prefix = keys.workflow_owner_holder("")
    names = [f"wf-{n:04d}" for n in range(SCAN_PAGE * 2 + 20)] + ["wf-\u00e9t\u00e9-\u2713"]
    with open_storage(sqlite_url) as store:
        store.batch([Put(prefix + name, holder) for name in names])
    bad = {names[0], names[7], names[8], names[SCAN_PAGE], names[SCAN_PAGE + 1], names[-1]}
    for name in bad:
        _overwrite(sqlite_url, prefix + name, 7)

    with open_storage(sqlite_url, read_only=True) as store:
        rows = list(scan_rows(store, prefix))

    assert [key for key, _ in rows] == [prefix + name for name in names]
    unreadable = {key[len(prefix) :] for key, value in rows if isinstance(value, Unreadable)}
    assert unreadable == bad
    assert all(value == holder for _, value in rows if not isinstance(value, Unreadable))


def test_a_store_that_stops_answering_is_an_error_not_a_bad_row(
    private_cluster: PostgresCluster,
) -> None:
    url = f"{private_cluster.url}&timeout=0.5"
    with Ownership.open(url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    with open_storage(url, read_only=True) as store:
        assert [key for key, _ in scan_rows(store, keys.workflow(""))] == ["wf:wf-1"]
        private_cluster.stop(remove=False)

        with pytest.raises(StorageError):
            list(scan_rows(store, keys.workflow("")))
        with pytest.raises(StorageError):
            read_value(store, keys.workflow("wf-1"))


# -- show says what it could not read --------------------------------------------------------------


def test_show_of_a_corrupt_epoch_says_so_and_names_the_repair(
    storage_url: str, storage: Storage
) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    storage.put(keys.workflow_owner_epoch("wf-1"), b"\x01\x02\x03")
    before = dict(storage.scan(""))

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["epoch"] == (
        "(corrupt: 'wf-owner-epoch:wf-1' holds 3 bytes, not a valid epoch; claims of it are "
        "refused until 'weft-sync repair-epoch wf-1' replaces it)"
    )
    assert "mint" not in fields
    assert fields["status"] == "running"
    data = json.loads(run_cli("--url", storage_url, "show", "wf-1", "--json")[1])
    assert (data["epoch"], data["epoch_valid"]) == (None, False)
    assert list(data["problems"]) == ["wf-owner-epoch:wf-1"]
    assert dict(storage.scan("")) == before


def test_show_of_a_workflow_whose_epoch_is_absent_still_says_never_claimed(
    storage_url: str, storage: Storage
) -> None:
    storage.put(keys.workflow_owner_holder("lock-1"), b"\xc1")

    code, out = run_cli("--url", storage_url, "show", "lock-1")

    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["epoch"] == "(never claimed)"
    assert fields["holder"] == "('wf-owner-holder:lock-1' holds 1 byte, not a valid holder record)"


def test_show_of_an_undecodable_result_says_so(storage_url: str, storage: Storage) -> None:
    with Ownership.open(storage_url, background="manual") as engine:
        engine.workflows.start("wf-1", "report")
        engine.workflows.complete("wf-1", result={"rows": 12})
    storage.put(keys.workflow("wf-1") + ":result", b"\xc1\xc1")

    code, out = run_cli("--url", storage_url, "show", "wf-1")

    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["status"] == "completed"
    assert fields["result"] == "('wf:wf-1:result' holds 2 bytes, not a valid workflow result)"
    assert "finished" not in fields
    data = json.loads(run_cli("--url", storage_url, "show", "wf-1", "--json")[1])
    assert data["outcome"] is None
    assert data["problems"] == {
        "wf:wf-1:result": "'wf:wf-1:result' holds 2 bytes, not a valid workflow result"
    }


# -- maintain --once with a handler that raises ----------------------------------------------------


def test_maintain_once_reports_a_raising_handler_in_one_line_and_drives_the_rest(
    sqlite_url: str,
) -> None:
    abandon(sqlite_url, "wf-1")
    abandon(sqlite_url, "wf-2")

    done = run_cli_process(
        "--url", sqlite_url, "maintain", "--once", "--handler", "tests.cli.handler:explode_on_wf_1"
    )

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "s3cret" not in done.stderr + done.stdout
    lines = done.stderr.splitlines()
    assert all(line.startswith("weft-sync: ") for line in lines), done.stderr
    assert (
        "weft-sync: error: handler for workflow type 'report' raised on workflow 'wf-1' "
        "(epoch 2); its claim is released for a redrive "
        "(RuntimeError: cannot drive wf-1 at postgresql://app:***@db/main)"
    ) in lines
    assert not [line for line in lines if "wf-2" in line]
    assert "error on wf-1: cannot drive wf-1" in done.stdout
    assert "maintenance pass FAILED" in done.stdout
    with open_storage(sqlite_url, read_only=True) as store:
        assert holder_engine(store, "wf-1") is None  # released for a redrive
    with Ownership.open(sqlite_url, background="manual") as reader:
        finished = reader.workflows.get("wf-2")
        failed = reader.workflows.get("wf-1")
    assert finished is not None and finished.status == "completed"
    assert failed is not None and failed.status == "running"


def test_maintain_once_with_debug_shows_the_handler_traceback(sqlite_url: str) -> None:
    abandon(sqlite_url, "wf-1")
    argv = cli_command(
        "--url", sqlite_url, "maintain", "--once", "--handler", "tests.cli.handler:explode"
    )

    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=WAIT_S, env=cli_env(WEFT_SYNC_DEBUG="1")
    )

    assert done.returncode == 1
    assert "weft-sync: error: handler for workflow type 'report' raised on workflow 'wf-1'" in (
        done.stderr
    )
    assert "Traceback (most recent call last):" in done.stderr
    assert 'in explode\n    raise RuntimeError(f"cannot drive' in done.stderr
    assert "s3cret" not in done.stderr


# -- a bad port or sslmode is a usage error --------------------------------------------------------

BAD_URLS = [
    ("postgresql://weft:s3cret@127.0.0.1:99999/app", "'99999'"),
    ("postgresql://weft:s3cret@127.0.0.1:abc/app", "'abc'"),
    ("postgresql://weft:s3cret@[::1]:0/app", "'0'"),
    ("postgresql://weft:s3cret@db1:5432,db2:x/app", "'x'"),
    ("postgresql://weft:s3cret@127.0.0.1/app?port=70000", "port='70000'"),
    ("postgres://weft:s3cret@127.0.0.1/app?sslmode=bogus", "sslmode='bogus'"),
]


@pytest.mark.parametrize("argv", [["claims"], ["doctor"], ["maintain", "--once"]], ids=" ".join)
@pytest.mark.parametrize(("url", "value"), BAD_URLS, ids=[v for _, v in BAD_URLS])
def test_a_bad_port_or_sslmode_exits_2_naming_the_value(
    url: str, value: str, argv: list[str]
) -> None:
    done = run_cli_process("--url", url, *argv)

    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr, "bad store URL from --url", value)
    assert "s3cret" not in done.stderr + done.stdout
    valid = "verify-full" if "sslmode" in value else "a whole number from 1 to 65535"
    assert valid in done.stderr


@pytest.mark.parametrize(
    "template",
    [
        "postgresql://weft@127.0.0.1:{port}/app?sslmode=verify-full",
        "postgresql://weft@/app?host=127.0.0.1&port={port}",
    ],
    ids=["sslmode", "port-parameter"],
)
def test_a_valid_sslmode_or_port_is_not_refused(template: str) -> None:
    url = template.format(port=_refusing_port())

    done = run_cli_process("--url", url, "claims")

    assert done.returncode == 1
    assert_one_line_no_traceback(done.stderr, "could not reach")


# -- a SQLite file this process may not reach ------------------------------------------------------


def _without_dac_override() -> list[str]:
    """A command prefix that runs a child without root's permission bypass; skips if none."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: the permission check cannot be tested")
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=WAIT_S)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.decode().strip()}")
    return prefix


class LockedStore(NamedTuple):
    url: str
    directory: Path
    contents: list[str]
    prefix: list[str]
    """How to run a child that the directory's permissions apply to."""


@pytest.fixture
def locked_store(tmp_path: Path) -> Iterator[LockedStore]:
    """A store with workflow ``wf-1`` in a directory of mode 000."""
    directory = tmp_path / "locked"
    directory.mkdir()
    url = f"sqlite:///{directory / 'jobs.db'}"
    with Ownership.open(url, background="manual") as engine:
        engine.workflows.start("wf-1", "job")
    store = LockedStore(url, directory, sorted(os.listdir(directory)), _without_dac_override())
    directory.chmod(0)
    try:
        probe = subprocess.run([*store.prefix, "ls", str(directory)], capture_output=True)
        if probe.returncode == 0:
            pytest.skip("this process may search a directory of mode 000")
        yield store
    finally:
        directory.chmod(0o755)


def _run_locked(store: LockedStore, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*store.prefix, *cli_command("--url", store.url, *argv)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=cli_env(),
    )


@pytest.mark.parametrize(
    "argv", [["claims"], ["show", "wf-1"], ["maintain", "--once"], ["cancel", "wf-1"]], ids=" ".join
)
def test_a_store_behind_an_unsearchable_directory_is_reported_as_permission_denied(
    locked_store: LockedStore, argv: list[str]
) -> None:
    done = _run_locked(locked_store, *argv)

    assert (done.returncode, done.stdout) == (1, "")
    assert_one_line_no_traceback(
        done.stderr, "permission denied", f"may not search the directory '{locked_store.directory}'"
    )
    assert "does not exist" not in done.stderr


@pytest.mark.parametrize("fix", [False, True], ids=["doctor", "doctor --fix"])
def test_doctor_on_an_unsearchable_directory_does_not_suggest_fix(
    locked_store: LockedStore, fix: bool
) -> None:
    done = _run_locked(locked_store, "doctor", *(["--fix"] if fix else []))

    assert (done.returncode, done.stderr) == (1, "")
    lines = done.stdout.splitlines()
    assert lines[1].startswith("[FAIL] open the store: cannot open the SQLite store ")
    assert f"may not search the directory '{locked_store.directory}'" in lines[1]
    assert lines[-1] == "1 problem(s) found"
    locked_store.directory.chmod(0o755)
    assert sorted(os.listdir(locked_store.directory)) == locked_store.contents


def test_doctor_on_another_applications_sqlite_database_does_not_suggest_fix(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO orders (total) VALUES (9.5)")
    conn.close()
    before = path.read_bytes()

    done = run_cli_process("--url", f"sqlite:///{path}", "doctor")

    assert (done.returncode, done.stderr) == (1, "")
    lines = done.stdout.splitlines()
    assert "has no table 'weft_kv'" in lines[1]
    assert "--fix" not in done.stdout
    assert lines[-1] == (
        "1 problem(s) found; the file exists but has no such table: check the path and ?table= "
        "in the URL"
    )
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["app.db"]


def test_doctor_on_a_weft_sync_file_under_another_table_name_does_not_suggest_fix(
    sqlite_url: str,
) -> None:
    Ownership.open(sqlite_url, background="manual").close()
    before = _dump(sqlite_url)

    done = run_cli_process("--url", f"{sqlite_url}?table=jobs_typo", "doctor")

    assert done.returncode == 1
    assert "has no table 'jobs_typo'" in done.stdout
    assert "--fix" not in done.stdout
    assert _dump(sqlite_url) == before


def test_doctor_on_a_missing_sqlite_file_still_suggests_fix(sqlite_url: str) -> None:
    done = run_cli_process("--url", sqlite_url, "doctor")

    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == "1 problem(s) found; 'weft-sync doctor --fix' creates it"


# -- a PostgreSQL server that cannot be reached ----------------------------------------------------


def _refusing_port() -> int:
    """A local TCP port nothing listens on (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("argv", [["claims"], ["maintain", "--once"]], ids=" ".join)
def test_a_refused_connection_says_the_server_could_not_be_reached(argv: list[str]) -> None:
    port = _refusing_port()
    url = f"postgresql://weft:s3cret@127.0.0.1:{port}/app"

    done = run_cli_process("--url", url, *argv)

    assert (done.returncode, done.stdout) == (1, "")
    assert_one_line_no_traceback(
        done.stderr,
        f"could not reach the PostgreSQL server at 127.0.0.1:{port}: connection refused",
        f"'postgresql://weft:***@127.0.0.1:{port}/app' from --url",
    )
    assert "table setup" not in done.stderr
    assert "s3cret" not in done.stderr


def test_doctor_on_an_unreachable_server_says_so_and_does_not_suggest_fix(
    tmp_path: Path,
) -> None:
    url = f"postgresql://weft:s3cret@/app?host={tmp_path}"

    done = run_cli_process("--url", url, "doctor")

    assert (done.returncode, done.stderr) == (1, "")
    lines = done.stdout.splitlines()
    assert lines[1] == (
        f"[FAIL] open the store: could not reach the PostgreSQL server at socket "
        f"{tmp_path}/.s.PGSQL.5432: no such file or directory (store URL "
        f"'postgresql://weft:***@/app?host={tmp_path}' from --url)"
    )
    assert lines[-1] == "1 problem(s) found"


def test_a_server_that_answers_is_not_called_unreachable(postgres_base_url: str) -> None:
    parts = urlsplit(postgres_base_url)
    url = urlunsplit(parts._replace(path="/weft_no_such_database"))

    done = run_cli_process("--url", url, "claims")

    assert done.returncode == 1
    assert_one_line_no_traceback(done.stderr, "weft_no_such_database", "does not exist")
    assert "could not reach" not in done.stderr
