"""``open_storage(url, read_only=True)`` on both backends: reads work, nothing is ever created."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from weft_sync.errors import ReadOnlyStorageError, StorageError
from weft_sync.storage import Condition, Delete, Put, Storage, open_storage


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///").partition("?")[0])


def _table_exists(storage_url: str) -> bool:
    try:
        open_storage(storage_url, read_only=True).close()
    except StorageError:
        return False
    return True


def test_read_only_store_reads_what_a_writer_wrote(storage_url: str, storage: Storage) -> None:
    storage.put("k1", b"v1")
    storage.put("k2", b"v2")

    with open_storage(storage_url, read_only=True) as reader:
        assert reader.get("k1") == b"v1"
        assert reader.get("absent") is None
        assert reader.scan("k") == [("k1", b"v1"), ("k2", b"v2")]
        storage.put("k3", b"v3")
        assert reader.get("k3") == b"v3"


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s.put("k1", b"changed"),
        lambda s: s.delete("k1"),
        lambda s: s.batch([Put("k1", b"changed")]),
        lambda s: s.conditional_batch([Condition("k1", b"v1")], [Put("k1", b"changed")]),
        lambda s: s.conditional_batch([Condition("new", None)], [Put("new", b"x")]),
        lambda s: s.conditional_batches([([Condition("k1", b"v1")], [Delete("k1")])]),
    ],
    ids=["put", "delete", "batch", "cas", "cas-absent", "cas-batches"],
)
def test_every_write_on_a_read_only_store_raises_and_changes_nothing(
    storage_url: str, storage: Storage, write: object
) -> None:
    storage.put("k1", b"v1")

    with (
        open_storage(storage_url, read_only=True) as reader,
        pytest.raises(ReadOnlyStorageError, match="read-only"),
    ):
        write(reader)  # type: ignore[operator]

    assert dict(storage.scan("")) == {"k1": b"v1"}


def test_a_missing_table_is_an_error_and_is_not_created(storage_url: str, backend: str) -> None:
    if backend == "sqlite":  # the file exists, with another table only
        open_storage(f"sqlite:///{_sqlite_path(storage_url)}?table=theirs").close()

    with pytest.raises(StorageError, match=r"no table 't_[0-9a-f]+'.*not created"):
        open_storage(storage_url, read_only=True)

    assert not _table_exists(storage_url)


def test_a_missing_sqlite_file_is_an_error_and_no_file_appears(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        open_storage(f"sqlite:///{tmp_path / 'typo.db'}", read_only=True)

    assert os.listdir(tmp_path) == []


def test_an_existing_sqlite_file_without_the_table_gets_no_table_and_no_lock_file(
    tmp_path: Path,
) -> None:
    with open_storage(f"sqlite:///{tmp_path / 'app.db'}?table=theirs") as other:
        other.put("x", b"1")
    (tmp_path / "app.db.lock").unlink()

    with pytest.raises(StorageError, match="no table 'weft_kv'"):
        open_storage(f"sqlite:///{tmp_path / 'app.db'}", read_only=True)

    with open_storage(f"sqlite:///{tmp_path / 'app.db'}?table=theirs", read_only=True) as reader:
        assert reader.get("x") == b"1"
        with pytest.raises(ReadOnlyStorageError):
            reader.put("x", b"2")
    assert not (tmp_path / "app.db.lock").exists()
    with pytest.raises(StorageError, match="no table 'weft_kv'"):
        open_storage(f"sqlite:///{tmp_path / 'app.db'}", read_only=True)


def test_read_only_sqlite_starts_no_writer_thread(tmp_path: Path) -> None:
    storage_url = f"sqlite:///{tmp_path / 'store.db'}"
    open_storage(storage_url).close()
    before = {t.name for t in threading.enumerate()}
    with open_storage(storage_url, read_only=True) as reader:
        reader.get("k")
        with pytest.raises(ReadOnlyStorageError):
            reader.put("k", b"v")
        started = {t.name for t in threading.enumerate()} - before
    assert not [name for name in started if "writer" in name]
