"""``compare_and_set_many`` on every backend, and the helper that falls back without it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.claims.gated import BatchesOnly
from weft_sync.errors import ClosedError, StorageCapabilityError, StorageError
from weft_sync.storage import Condition, Put, Storage
from weft_sync.storage.cas import (
    CasRow,
    SupportsCompareAndSetMany,
    storage_compare_and_set_many,
    validate_cas_rows,
)

OpenStore = Callable[[], Storage]


def _native(storage: Storage) -> SupportsCompareAndSetMany:
    assert isinstance(storage, SupportsCompareAndSetMany)
    return storage


def test_every_backend_has_a_native_compare_and_set_many(storage: Storage) -> None:
    assert isinstance(storage, SupportsCompareAndSetMany)


def test_rows_commit_independently_and_report_each_outcome(storage: Storage) -> None:
    storage.batch([Put("a", b"1"), Put("b", b"1"), Put("c", b"1")])
    results = _native(storage).compare_and_set_many(
        [("a", b"1", b"2"), ("b", b"stale", b"2"), ("absent", b"1", b"2"), ("c", b"1", b"3")]
    )
    assert results == [True, False, False, True]
    assert storage.scan() == [("a", b"2"), ("b", b"1"), ("c", b"3")]


def test_a_row_is_judged_after_the_rows_before_it(storage: Storage) -> None:
    storage.put("k", b"1")
    results = _native(storage).compare_and_set_many(
        [("k", b"1", b"2"), ("k", b"1", b"lost"), ("k", b"2", b"3")]
    )
    assert results == [True, False, True]
    assert storage.get("k") == b"3"


def test_the_whole_value_is_compared_byte_for_byte(storage: Storage) -> None:
    storage.put("k", b"abc")
    cas = _native(storage)
    assert cas.compare_and_set_many([("k", b"ab", b"x"), ("k", b"abcd", b"x")]) == [False, False]
    assert cas.compare_and_set_many([("k", b"abc", b"")]) == [True]
    assert storage.get("k") == b""


def test_bytes_like_values_are_stored_as_bytes(storage: Storage) -> None:
    storage.put("k", b"1")
    row: Any = ("k", bytearray(b"1"), memoryview(b"2"))
    assert _native(storage).compare_and_set_many([row]) == [True]
    assert storage.get("k") == b"2"


def test_an_empty_list_returns_an_empty_list(storage: Storage) -> None:
    assert _native(storage).compare_and_set_many([]) == []


def test_many_rows_in_one_call(storage: Storage) -> None:
    keys = [f"holder/{n:05d}" for n in range(3000)]
    storage.batch([Put(k, b"old") for k in keys])
    rows = [(k, b"old" if n % 7 else b"stale", k.encode()) for n, k in enumerate(keys)]
    results = _native(storage).compare_and_set_many(rows)
    assert results == [n % 7 != 0 for n in range(len(keys))]
    stored = dict(storage.scan("holder/"))
    assert all(stored[k] == (k.encode() if n % 7 else b"old") for n, k in enumerate(keys))


BAD_ROWS: list[tuple[str, object, type[Exception], str]] = [
    ("rows as a str", "abc", TypeError, "'abc'"),
    ("rows as bytes", b"abc", TypeError, "b'abc'"),
    ("row not a tuple", [("k", b"1", b"2"), "k"], TypeError, "row 1"),
    ("row of two", [("k", b"1")], TypeError, r"row 0 .*\('k', b'1'\)"),
    ("int key", [(5, b"1", b"2")], TypeError, "5"),
    ("NUL key", [("k", b"1", b"2"), ("k\x00", b"1", b"2")], ValueError, r"k\\x00"),
    ("surrogate key", [("k\ud800", b"1", b"2")], ValueError, r"k\\ud800"),
    ("str expected", [("k", "1", b"2")], TypeError, r"row 0 \(key 'k'\): expected .*'1'"),
    ("None new", [("k", b"1", None)], TypeError, r"row 0 \(key 'k'\): new .*None"),
    (
        "row of four after a good row",
        [("k", b"1", b"2"), ("j", b"1", b"2", b"3")],
        TypeError,
        "row 1",
    ),
    ("int key after a good row", [("k", b"1", b"2"), (7, b"1", b"2")], TypeError, "7"),
    ("str new after a good row", [("k", b"1", b"2"), ("j", b"1", "2")], TypeError, "row 1"),
]


@pytest.mark.parametrize(
    ("rows", "error", "named"), [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS]
)
def test_bad_rows_raise_naming_the_row_and_write_nothing(
    storage: Storage, rows: Any, error: type[Exception], named: str
) -> None:
    storage.put("k", b"1")
    with pytest.raises(error, match=named):
        _native(storage).compare_and_set_many(rows)
    with pytest.raises(error, match=named):
        storage_compare_and_set_many(BatchesOnly(storage), rows)  # type: ignore[arg-type]
    assert storage.scan() == [("k", b"1")]


def test_a_call_after_close_raises_closed_error(open_store: OpenStore) -> None:
    store = open_store()
    store.put("k", b"1")
    store.close()
    with pytest.raises(ClosedError):
        _native(store).compare_and_set_many([("k", b"1", b"2")])
    with pytest.raises(ClosedError):
        _native(store).compare_and_set_many([])
    assert open_store().get("k") == b"1"


# -- the helper -------------------------------------------------------------------------------


def test_the_helper_falls_back_to_conditional_batches_with_the_same_outcome(
    storage: Storage,
) -> None:
    storage.batch([Put("a", b"1"), Put("b", b"1")])
    plain = BatchesOnly(storage)
    rows: list[CasRow] = [("a", b"1", b"2"), ("b", b"x", b"2"), ("a", b"2", b"3")]
    assert storage_compare_and_set_many(plain, rows) == [True, False, True]  # type: ignore[arg-type]
    assert plain.batches_calls == 1
    assert storage.scan() == [("a", b"3"), ("b", b"1")]


def test_the_helper_refuses_a_store_without_the_cas_capability(storage: Storage) -> None:
    storage.put("a", b"1")
    with pytest.raises(StorageCapabilityError, match="conditional_batch"):
        storage_compare_and_set_many(
            BatchesOnly(storage, capable=False),  # type: ignore[arg-type]
            [("a", b"1", b"2")],
        )
    assert storage.get("a") == b"1"


def test_the_helper_reports_a_backend_returning_too_few_results(storage: Storage) -> None:
    storage.put("a", b"1")
    with pytest.raises(StorageError, match="returned 0 results for 1 rows"):
        storage_compare_and_set_many(
            BatchesOnly(storage, drop_result=True),  # type: ignore[arg-type]
            [("a", b"1", b"2")],
        )


def test_validate_cas_rows_returns_the_list_itself_when_every_row_is_plain() -> None:
    rows: list[CasRow] = [("a", b"1", b"2"), ("\u00e9\U0001f600", b"", b"x")]
    assert validate_cas_rows(rows) is rows
    assert validate_cas_rows(tuple(rows)) == rows
    assert validate_cas_rows([["a", b"1", b"2"]]) == [("a", b"1", b"2")]  # type: ignore[list-item]


# -- against the general path -----------------------------------------------------------------

_counter = itertools.count()
_KEYS = ("k0", "k1", "k2")
_VALUES = (b"", b"1", b"2", b"3")


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    initial=st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_VALUES)),
    rows=st.lists(
        st.tuples(st.sampled_from(_KEYS), st.sampled_from(_VALUES), st.sampled_from(_VALUES)),
        max_size=8,
    ),
)
def test_compare_and_set_many_equals_one_conditional_batch_per_row(
    storage: Storage, initial: dict[str, bytes], rows: list[tuple[str, bytes, bytes]]
) -> None:
    run = next(_counter)
    native_ns, sequential_ns = f"n{run}/", f"s{run}/"
    for ns in (native_ns, sequential_ns):
        storage.batch([Put(ns + k, v) for k, v in initial.items()])
    native = _native(storage).compare_and_set_many([(native_ns + k, e, n) for k, e, n in rows])
    sequential = [
        storage.conditional_batch([Condition(sequential_ns + k, e)], [Put(sequential_ns + k, n)])
        for k, e, n in rows
    ]
    assert native == sequential
    strip = len(native_ns)
    assert [(k[strip:], v) for k, v in storage.scan(native_ns)] == [
        (k[len(sequential_ns) :], v) for k, v in storage.scan(sequential_ns)
    ]
