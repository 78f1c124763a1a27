"""``get_many`` on every backend, and ``storage_get_many``, which falls back to ``get`` per key."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlitedict import SqliteDict

from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import Put, SqliteStorage, Storage
from weft_sync.storage.reads import SupportsGetMany, storage_get_many, validate_keys

OpenStore = Callable[[], Storage]
_WAIT_S = 30.0


def _native(storage: Storage) -> SupportsGetMany:
    assert isinstance(storage, SupportsGetMany)
    return storage


class GetOnly:
    """A real store seen through the Storage protocol alone (no ``get_many``); counts ``get``."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.get_calls = 0

    def get(self, key: str) -> bytes | None:
        self.get_calls += 1
        return self.inner.get(key)

    def __getattr__(self, name: str) -> Any:
        if name == "get_many":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ShortGetMany:
    """A real store whose ``get_many`` drops the last value, breaking the contract."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return _native(self.inner).get_many(keys)[:-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_every_backend_has_a_native_get_many(storage: Storage) -> None:
    assert isinstance(storage, SupportsGetMany)
    assert not isinstance(GetOnly(storage), SupportsGetMany)


def test_values_come_back_in_key_order_with_none_for_absent_keys(storage: Storage) -> None:
    storage.batch([Put("a", b"A"), Put("b", b"B"), Put("c", b"C")])
    got = _native(storage).get_many(["c", "missing", "a", "b", "other"])
    assert got == [b"C", None, b"A", b"B", None]


def test_a_repeated_key_gets_its_value_at_each_position(storage: Storage) -> None:
    storage.batch([Put("a", b"A"), Put("b", b"B")])
    got = _native(storage).get_many(["a", "b", "a", "x", "a", "x"])
    assert got == [b"A", b"B", b"A", None, b"A", None]


def test_an_empty_list_returns_an_empty_list(storage: Storage) -> None:
    assert _native(storage).get_many([]) == []
    assert _native(storage).get_many(()) == []
    assert storage_get_many(GetOnly(storage), []) == []


def test_a_tuple_of_keys_is_accepted(storage: Storage) -> None:
    storage.put("a", b"A")
    assert _native(storage).get_many(("a", "b")) == [b"A", None]


def test_non_ascii_keys_are_read_exactly(storage: Storage) -> None:
    keys = ["\u00e9", "\u00e9x", "\ue000", "\U0001f600", "\U0010ffff", "\u65e5\u672c/\u0416"]
    storage.batch([Put(k, k.encode("utf-8")) for k in keys[::2]])
    got = _native(storage).get_many([*reversed(keys), "e"])
    expected = [k.encode("utf-8") if i % 2 == 0 else None for i, k in enumerate(keys)]
    assert got == [*reversed(expected), None]


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", b"\x00\xff\x00binary", bytes(range(256)) * 400],
    ids=["empty", "nul", "binary", "100k"],
)
def test_values_are_the_exact_stored_bytes(storage: Storage, value: bytes) -> None:
    storage.batch([Put("k", value), Put("other", b"o")])
    got = _native(storage).get_many(["k", "other", "absent"])
    assert got == [value, b"o", None]
    assert type(got[0]) is bytes
    assert type(got[1]) is bytes


def test_more_keys_than_one_query_chunk_are_all_read_in_order(storage: Storage) -> None:
    present = [f"key/{n:05d}" for n in range(1300)]
    storage.batch([Put(k, k.encode()) for k in present if int(k[-5:]) % 3])
    asked = present + [f"none/{n}" for n in range(200)]
    random.Random(7).shuffle(asked)
    asked += asked[:600]  # repeats that land in other chunks than their first occurrence
    got = _native(storage).get_many(asked)
    assert len(got) == len(asked)
    for key, value in zip(asked, got, strict=True):
        stored = key.startswith("key/") and int(key[-5:]) % 3 != 0
        assert value == (key.encode() if stored else None), key


def test_all_keys_are_read_from_one_snapshot(storage: Storage, open_store: OpenStore) -> None:
    keys = [f"snap/{n:04d}" for n in range(700)]
    storage.batch([Put(k, b"0") for k in keys])
    writer_store = open_store()
    done = threading.Event()
    errors: list[BaseException] = []

    def write_rounds() -> None:
        try:
            for n in range(1, 31):
                writer_store.batch([Put(k, str(n).encode()) for k in keys])
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=write_rounds, name="get-many-writer", daemon=True)
    writer.start()
    seen: set[bytes | None] = set()
    try:
        while not done.is_set() or not seen:
            values = _native(storage).get_many(keys)
            assert len(set(values)) == 1, f"a torn read: {sorted(set(map(repr, values)))[:5]}"
            seen.add(values[0])
    finally:
        writer.join(_WAIT_S)
    for exc in errors:
        raise exc
    assert _native(storage).get_many(keys) == [b"30"] * len(keys)


BAD_KEYS: list[tuple[str, object, type[Exception], str]] = [
    ("a str", "abc", TypeError, "str 'abc'"),
    ("bytes", b"abc", TypeError, "bytes b'abc'"),
    ("a set", {"a"}, TypeError, "set"),
    ("an int key", ["a", "b", 5], TypeError, "int 5"),
    ("a bytes key", ["a", b"b"], TypeError, "bytes b'b'"),
    ("a None key", [None], TypeError, "NoneType None"),
    ("a NUL key", ["a", "k\x00"], ValueError, r"'k\\x00'.*NUL"),
    ("a lone surrogate key", ["a", "k\ud800"], ValueError, r"'k\\ud800'.*surrogate"),
]


@pytest.mark.parametrize(
    ("keys", "error", "named"), [c[1:] for c in BAD_KEYS], ids=[c[0] for c in BAD_KEYS]
)
def test_bad_keys_raise_naming_the_value_before_any_read(
    storage: Storage, keys: Any, error: type[Exception], named: str
) -> None:
    storage.put("a", b"A")
    with pytest.raises(error, match=named):
        _native(storage).get_many(keys)
    with pytest.raises(error, match=named):
        storage_get_many(storage, keys)
    plain = GetOnly(storage)
    with pytest.raises(error, match=named):
        storage_get_many(plain, keys)
    assert plain.get_calls == 0
    with pytest.raises(error, match=named):
        validate_keys(keys)
    assert storage.scan() == [("a", b"A")]


def test_validate_keys_returns_the_keys_as_a_list() -> None:
    assert validate_keys(("a", "\U0001f600", "a")) == ["a", "\U0001f600", "a"]
    assert validate_keys([]) == []


def test_a_call_after_close_raises_closed_error(open_store: OpenStore) -> None:
    store = open_store()
    store.put("k", b"1")
    store.close()
    with pytest.raises(ClosedError):
        _native(store).get_many(["k"])
    with pytest.raises(ClosedError):
        _native(store).get_many([])
    with pytest.raises(ClosedError):
        storage_get_many(store, ["k", "other"])
    assert _native(open_store()).get_many(["k"]) == [b"1"]


# -- the helper -------------------------------------------------------------------------------


def test_the_helper_uses_the_native_get_many(storage: Storage) -> None:
    storage.batch([Put("a", b"A"), Put("b", b"")])
    assert storage_get_many(storage, ["b", "x", "a", "b"]) == [b"", None, b"A", b""]


def test_the_helper_falls_back_to_one_get_per_key_with_the_same_values(storage: Storage) -> None:
    storage.batch([Put("a", b"A"), Put("b", b""), Put("\u00e9", b"\xff")])
    keys = ["b", "x", "a", "\u00e9", "a", "missing"]
    plain = GetOnly(storage)
    fallback = storage_get_many(plain, keys)
    assert plain.get_calls == len(keys)
    assert fallback == _native(storage).get_many(keys)
    assert fallback == [b"", None, b"A", b"\xff", b"A", None]


def test_the_helper_reports_a_backend_returning_the_wrong_number_of_values(
    storage: Storage,
) -> None:
    storage.batch([Put("a", b"A"), Put("b", b"B")])
    short = ShortGetMany(storage)
    assert isinstance(short, SupportsGetMany)
    with pytest.raises(StorageError, match="returned 2 values for 3 keys"):
        storage_get_many(short, ["a", "b", "c"])


def test_the_helper_after_close_raises_closed_error_on_the_fallback(open_store: OpenStore) -> None:
    store = open_store()
    store.close()
    with pytest.raises(ClosedError):
        storage_get_many(GetOnly(store), ["k"])


# -- SQLite ------------------------------------------------------------------------------------


def _identity(value: object) -> object:
    return value


def test_sqlite_text_values_of_a_foreign_writer_come_back_as_utf8_bytes(tmp_path: Path) -> None:
    path, table = tmp_path / "foreign.db", "kv"
    with SqliteDict(
        path,
        tablename=table,
        journal_mode="WAL",
        encode=_identity,
        decode=_identity,
        outer_stack=False,
    ) as written:
        written["blob"] = b"\xffB"
        written["text"] = "stored as TEXT"
        written["\u00e9"] = "\u00e9\u20ac\U0001f600"
        written.commit()
    with SqliteStorage(path, table=table) as store:
        got = store.get_many(["text", "blob", "\u00e9", "none"])
        assert got == [b"stored as TEXT", b"\xffB", "\u00e9\u20ac\U0001f600".encode(), None]
        assert all(type(value) is bytes for value in got[:3])
        assert storage_get_many(GetOnly(store), ["text", "\u00e9"]) == got[::2]
