"""open_storage: the storage URL forms and how malformed URLs are refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from weft_sync.storage import SqliteStorage, open_storage


def _tables(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    finally:
        conn.close()
    # weft_open_paths: the paths engines have the file open through (one per file, not a store).
    return [name for (name,) in rows if name != "weft_open_paths"]


def test_three_slashes_name_a_path_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with open_storage("sqlite:///data/store.db") as store:
        assert isinstance(store, SqliteStorage)
        store.put("k", b"v")
    assert _tables(tmp_path / "data" / "store.db") == ["weft_kv"]


def test_four_slashes_name_an_absolute_path(tmp_path: Path) -> None:
    path = tmp_path / "abs.db"
    assert path.is_absolute()
    with open_storage(f"sqlite:///{path}") as store:
        store.put("k", b"v")
        assert store.get("k") == b"v"
    assert _tables(path) == ["weft_kv"]


def test_query_parameters_configure_the_sqlite_storage(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    url = f"sqlite:///{path}?table=my_table&busy_timeout_ms=250&synchronous=NORMAL"
    with open_storage(url) as store:
        assert isinstance(store, SqliteStorage)
        assert store.table == "my_table"
        conn = store._readers.for_thread().conn
        assert conn is not None
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 250
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1
    assert _tables(path) == ["my_table"]


@pytest.mark.parametrize("url", ["redis://localhost/0", "file:///tmp/x.db", "store.db", ""])
def test_unknown_scheme_is_refused_naming_the_supported_ones(url: str) -> None:
    with pytest.raises(ValueError, match="sqlite://, postgresql://, postgres://") as info:
        open_storage(url)
    assert repr(url) in str(info.value)


def test_non_string_url_is_refused() -> None:
    with pytest.raises(TypeError, match="Path"):
        open_storage(Path("x.db"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("?journal=WAL", "'journal'.*table, busy_timeout_ms, synchronous"),
        ("?busy_timeout_ms=soon", "busy_timeout_ms='soon'.*whole number"),
        ("?busy_timeout_ms=-5", "-5"),
        ("?synchronous=OFF", "'OFF'.*FULL, NORMAL"),
        ("?table=a;b", "'a;b'"),
        ("?table=a&table=b", "'table' twice"),
    ],
)
def test_bad_sqlite_parameters_are_refused_naming_them(
    tmp_path: Path, query: str, named: str
) -> None:
    path = tmp_path / "bad.db"
    with pytest.raises(ValueError, match=named):
        open_storage(f"sqlite:///{path}{query}")
    assert not path.exists()


@pytest.mark.parametrize(
    ("url", "named"),
    [("sqlite://host/x.db", "names a host"), ("sqlite:///", "no file path")],
)
def test_sqlite_url_without_a_usable_path_is_refused(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        open_storage(url)
