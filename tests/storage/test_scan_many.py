"""``storage_scan_many``: several bounded scans, native on PostgreSQL, one by one elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from weft_sync.errors import StorageError
from weft_sync.storage import PostgresStorage, Put, Storage
from weft_sync.storage.reads import ScanRange, storage_scan_many


class Forwarding:
    """A real store behind a wrapper that forwards what it does not define; counts scans."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.scans: list[str] = []

    def scan(self, prefix: str = "", **bounds: Any) -> list[tuple[str, bytes]]:
        self.scans.append(prefix)
        return self.inner.scan(prefix, **bounds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ShortScanMany(PostgresStorage):
    """A store whose ``scan_many`` drops the last result, breaking the contract."""

    def scan_many(self, ranges: Sequence[ScanRange]) -> list[list[tuple[str, bytes]]]:
        return super().scan_many(ranges)[:-1]


def _fill(storage: Storage) -> None:
    rows = [Put(f"a:{n:02d}", bytes([n])) for n in range(12)]
    rows += [Put(f"b:{n:02d}", b"") for n in range(5)]
    rows += [Put("a", b"bare"), Put("c:1", b"c"), Put("a;", b"after the prefix")]
    storage.batch(rows)


_RANGES = [
    ScanRange("a:", limit=4),
    ScanRange("a:", gt="a:05", limit=4),
    ScanRange("a:", gt="a:09", limit=4),  # short: the end of the prefix
    ScanRange("b:"),
    ScanRange("x:", limit=3),  # nothing there
    ScanRange("", gt="b:04", limit=2),
    ScanRange("a:", limit=0),
]


def test_each_range_gets_exactly_the_rows_of_its_scan(storage: Storage) -> None:
    _fill(storage)
    expected = [storage.scan(r.prefix, gt=r.gt, limit=r.limit) for r in _RANGES]
    assert [len(rows) for rows in expected] == [4, 4, 2, 5, 0, 1, 0]

    assert storage_scan_many(storage, _RANGES) == expected
    assert storage_scan_many(storage, list(reversed(_RANGES))) == list(reversed(expected))
    assert storage_scan_many(storage, []) == []
    for scan, rows in zip(_RANGES, expected, strict=True):
        assert storage_scan_many(storage, [scan]) == [rows]


def test_only_postgresql_scans_in_one_statement(storage: Storage) -> None:
    native = getattr(type(storage), "scan_many", None)
    assert (native is not None) == isinstance(storage, PostgresStorage)


def test_a_forwarding_wrapper_gets_its_own_scans_called(storage: Storage) -> None:
    _fill(storage)
    wrapper = Forwarding(storage)
    got = storage_scan_many(wrapper, [ScanRange("a:", limit=3), ScanRange("b:")])  # type: ignore[arg-type]
    assert wrapper.scans == ["a:", "b:"]
    assert [len(rows) for rows in got] == [3, 5]


@pytest.mark.parametrize(
    ("ranges", "error", "match"),
    [
        ("a:", TypeError, "sequence of ScanRange"),
        ([("a:", None, 3)], TypeError, "ScanRange items"),
        ([ScanRange("a:", limit=-1)], ValueError, "limit"),
        ([ScanRange("a:", gt="x\x00")], ValueError, "gt"),
    ],
)
def test_bad_ranges_are_refused_before_any_read(
    storage: Storage, ranges: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        storage_scan_many(storage, ranges)
    with pytest.raises(error, match=match):
        storage_scan_many(Forwarding(storage), ranges)  # type: ignore[arg-type]


def test_a_backend_returning_too_few_results_is_a_storage_error(storage: Storage) -> None:
    if not isinstance(storage, PostgresStorage):
        pytest.skip("only PostgreSQL scans several ranges natively")
    storage.__class__ = ShortScanMany
    try:
        with pytest.raises(StorageError, match="2 ranges"):
            storage_scan_many(storage, [ScanRange("a:"), ScanRange("b:")])
    finally:
        storage.__class__ = PostgresStorage
