"""Asking SQLite which file a ``sqlite3.Connection`` has open, without a statement."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

import pytest

from weft_sync.storage import sqlite_handle


@pytest.fixture
def reader() -> sqlite_handle.FilenameReader:
    found = sqlite_handle.filename_reader()
    if found is None:  # pragma: no cover - only off CPython or with another SQLite copy
        assert sys.implementation.name != "cpython" or os.environ.get("CI") != "true", (
            sqlite_handle.unavailable_reason()
        )
        pytest.skip(f"not available here: {sqlite_handle.unavailable_reason()}")
    return found


def test_it_is_available_on_cpython_with_the_modules_own_sqlite() -> None:
    if sys.implementation.name != "cpython":  # pragma: no cover
        pytest.skip("checked for CPython only")
    assert sqlite_handle.unavailable_reason() is None
    assert sqlite_handle.filename_reader() is not None


def test_it_reports_what_pragma_database_list_reports(
    reader: sqlite_handle.FilenameReader, tmp_path: Path
) -> None:
    conn = sqlite3.connect(str(tmp_path / "main.db"))
    try:
        conn.execute("ATTACH DATABASE ? AS other", (str(tmp_path / "other.db"),))
        conn.execute("ATTACH DATABASE ':memory:' AS scratch")
        listed = {schema: file for _seq, schema, file in conn.execute("PRAGMA database_list")}
        for schema, file in listed.items():
            assert reader(conn, schema.encode()) == file.encode(), schema
        assert reader(conn, b"main") == os.fsencode(os.path.realpath(tmp_path / "main.db"))
        assert reader(conn, b"scratch") == b""
        assert reader(conn, b"no_such_schema") is None
        conn.execute("DETACH DATABASE other")
        assert reader(conn, b"other") is None
    finally:
        conn.close()


def test_a_closed_connection_has_no_file(
    reader: sqlite_handle.FilenameReader, tmp_path: Path
) -> None:
    conn = sqlite3.connect(str(tmp_path / "main.db"))
    conn.close()
    assert reader(conn, b"main") is None


def test_a_deserialized_database_reports_a_bare_name(
    reader: sqlite_handle.FilenameReader, tmp_path: Path
) -> None:
    conn = sqlite3.connect(str(tmp_path / "main.db"))
    try:
        conn.execute("CREATE TABLE t (x)")
        data = conn.serialize()
        conn.deserialize(data)
        file = reader(conn, b"main")
        assert file is not None and not os.path.isabs(os.fsdecode(file))
    finally:
        conn.close()


def test_anything_but_a_sqlite3_connection_is_refused_before_its_memory_is_read(
    reader: sqlite_handle.FilenameReader,
) -> None:
    for wrong in (object(), "main", 12345):
        with pytest.raises(TypeError, match=r"not a sqlite3\.Connection"):
            reader(wrong, b"main")  # type: ignore[arg-type]


def test_a_subclass_of_sqlite3_connection_is_read_as_one(
    reader: sqlite_handle.FilenameReader, tmp_path: Path
) -> None:
    class Mine(sqlite3.Connection):
        pass

    conn = sqlite3.connect(str(tmp_path / "main.db"), factory=Mine)
    try:
        assert reader(conn, b"main") == os.fsencode(os.path.realpath(tmp_path / "main.db"))
    finally:
        conn.close()


def test_file_check_falls_back_to_its_judge_when_the_name_differs(tmp_path: Path) -> None:
    store = str(tmp_path / "store.db")
    seen: list[str | None] = []

    def judge(file: str | None) -> bool:
        seen.append(file)
        return False

    check = sqlite_handle.file_check("main", os.path.realpath(store), judge)
    if check is None:  # pragma: no cover
        pytest.skip(f"not available here: {sqlite_handle.unavailable_reason()}")
    on_store = sqlite3.connect(store)
    elsewhere = sqlite3.connect(str(tmp_path / "elsewhere.db"))
    try:
        assert check(on_store) is True and seen == []
        assert check(elsewhere) is False
        assert seen == [os.path.realpath(tmp_path / "elsewhere.db")]
    finally:
        on_store.close()
        elsewhere.close()
    assert check(on_store) is False and seen[-1] is None  # closed
