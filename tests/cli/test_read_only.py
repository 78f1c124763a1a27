"""Read-only commands never create a store, a table or a file, and never write; the commands
that write need an existing store too (only ``doctor --fix`` creates one)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from tests.cli.helpers import abandon, assert_one_line_no_traceback, run_cli
from weft_sync import Ownership
from weft_sync.errors import StorageError
from weft_sync.storage import SqliteStorage, Storage, open_storage

READ_COMMANDS = [
    ["claims"],
    ["claims", "--json"],
    ["workflows"],
    ["workflows", "--json"],
    ["show", "wf-1"],
    ["status"],
    ["status", "--json"],
    ["metrics"],
    ["metrics", "--store"],
]
IDS = [" ".join(argv) for argv in READ_COMMANDS]
WRITE_COMMANDS = [["maintain", "--once"], ["cancel", "wf-1"], ["release", "wf-1"]]
WRITE_IDS = [argv[0] for argv in WRITE_COMMANDS]


def _table_exists(url: str) -> bool:
    try:
        open_storage(url, read_only=True).close()
    except StorageError:
        return False
    return True


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=IDS)
def test_a_read_command_on_a_mistyped_sqlite_path_exits_1_and_creates_no_file(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'typo.db'}"

    assert run_cli("--url", url, *argv) == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "typo.db", "does not exist", "--url")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=IDS)
def test_a_read_command_on_a_missing_table_exits_1_and_creates_no_table(
    storage_url: str, storage: Storage, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The fixture's store (file and table) exists; "nope" is another table of the same database.
    url = storage_url.replace("table=", "table=nope_")

    assert run_cli("--url", url, *argv) == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "no table 'nope_t_", "not created")
    assert not _table_exists(url)


@pytest.mark.parametrize("argv", [*READ_COMMANDS, ["doctor"]], ids=[*IDS, "doctor"])
def test_a_read_command_writes_nothing_to_an_existing_store(
    storage_url: str, storage: Storage, argv: list[str]
) -> None:
    abandon(storage_url, "wf-1")  # an expired claim a writing engine would take over
    before = dict(storage.scan(""))

    code, _ = run_cli("--url", storage_url, *argv)

    assert code == 0
    assert dict(storage.scan("")) == before


# On PostgreSQL creating the table is how a store is set up; a SQLite file that exists without
# the table is not made a store, so doctor suggests checking the URL instead.
@pytest.mark.parametrize("backend", ["postgres"])
def test_doctor_on_a_database_without_the_weft_table_says_so_and_creates_none(
    storage_url: str, storage: Storage
) -> None:
    url = storage_url.replace("table=", "table=app_")

    code, out = run_cli("--url", url, "doctor")

    assert code == 1
    lines = out.splitlines()
    assert lines[0].endswith("(read-only)")
    assert lines[1].startswith("[FAIL] open the store: ")
    assert "no table 'app_t_" in lines[1]
    assert lines[-1] == "1 problem(s) found; 'weft-sync doctor --fix' creates it"
    assert not _table_exists(url)


def test_doctor_fix_creates_the_missing_table_and_runs_the_write_probe(
    storage_url: str, storage: Storage
) -> None:
    url = storage_url.replace("table=", "table=new_")

    code, out = run_cli("--url", url, "doctor", "--fix")

    assert code == 0, out
    assert "[ok] compare-and-swap refuses a stale write" in out.splitlines()
    assert out.splitlines()[-1] == "no problems found"
    assert _table_exists(url)
    with open_storage(url, read_only=True) as created:
        assert created.scan("") == []  # the probe cleaned up after itself


@pytest.mark.parametrize("argv", WRITE_COMMANDS, ids=WRITE_IDS)
def test_a_writing_command_on_a_missing_store_exits_1_and_creates_nothing(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'typo.db'}"

    assert run_cli("--url", url, *argv) == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "typo.db", "does not exist", "--url")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", WRITE_COMMANDS, ids=WRITE_IDS)
def test_a_writing_command_adds_no_table_to_another_database(
    storage_url: str, storage: Storage, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = storage_url.replace("table=", "table=app_")

    assert run_cli("--url", url, *argv) == (1, "")

    assert_one_line_no_traceback(capsys.readouterr().err, "no table 'app_t_", "not created")
    assert not _table_exists(url)


@pytest.mark.parametrize("argv", [*READ_COMMANDS, ["doctor"]], ids=[*IDS, "doctor"])
def test_a_read_command_on_a_cleanly_closed_sqlite_store_leaves_no_file_behind(
    tmp_path: Path, argv: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with Ownership.open(url, background="manual") as ownership:
        ownership.workflows.start("wf-1", "job")
    before = sorted(os.listdir(tmp_path))
    assert not [name for name in before if name.endswith(("-wal", "-shm"))]

    code, _ = run_cli("--url", url, *argv)

    assert code == 0
    assert sorted(os.listdir(tmp_path)) == before


def test_a_read_only_sqlite_store_refuses_write_statements_on_its_connections(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.db"
    SqliteStorage(path).close()
    with SqliteStorage(path, read_only=True) as store:
        conn = store._connect()
        try:
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                conn.execute("INSERT INTO weft_kv (key, value) VALUES ('k', x'00')")
        finally:
            conn.close()
