"""Reading many keys, or several key ranges, at once: one query instead of one per read.

``get_many(keys)`` is optional on a store: :func:`storage_get_many` uses it when a backend has it
and falls back to one ``get`` per key otherwise, with the same result. The native versions read
every key in one snapshot (one read transaction on SQLite, one statement on PostgreSQL); the
fallback reads them one after another.

``scan_many(ranges)`` is optional too: :func:`storage_scan_many` uses it when the store's class
defines it (PostgreSQL: one statement, so one round trip and one snapshot) and otherwise runs
one ``scan`` per range, with the same rows. A wrapper that forwards unknown attributes to
another store does not count as having it, so its own ``scan`` is what gets called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import StorageError
from .base import Storage, validate_key, validate_scan_args


@dataclass(frozen=True, slots=True)
class ScanRange:
    """One ``scan(prefix, gt=gt, limit=limit)`` of a :func:`storage_scan_many`."""

    prefix: str
    gt: str | None = None
    limit: int | None = None


class SupportsScanMany(Protocol):
    """A store with a native ``scan_many``.

    ``scan_many(ranges)`` returns, for each :class:`ScanRange` in order, exactly the rows
    ``scan(prefix, gt=gt, limit=limit)`` would return, all read in one snapshot. Bad ranges
    raise ``TypeError``/``ValueError`` before any I/O; driver failures raise ``StorageError``.
    """

    def scan_many(self, ranges: Sequence[ScanRange]) -> list[list[tuple[str, bytes]]]: ...


@runtime_checkable
class SupportsGetMany(Protocol):
    """A store with a native ``get_many``.

    ``get_many(keys)`` returns the stored bytes of each key, or ``None`` where it is absent, in
    the order of ``keys`` (a repeated key gets its value at each of its positions). Bad keys
    raise ``TypeError``/``ValueError`` before any I/O; driver failures raise ``StorageError``.
    """

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...


def validate_keys(keys: Sequence[str]) -> list[str]:
    """Check ``get_many`` keys before any I/O; return them as a list.

    :raises TypeError: ``keys`` is a single ``str``/``bytes`` or not a sequence, or a key is not
        a ``str``.
    :raises ValueError: a key is not storable (NUL character, lone surrogate).
    """
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
        raise TypeError(
            f"get_many() takes a sequence of str keys, got {type(keys).__name__} {keys!r:.80}"
        )
    return [validate_key(key) for key in keys]


def storage_get_many(storage: Storage, keys: Sequence[str]) -> list[bytes | None]:
    """Read ``keys``: in one query if the store can, else with one ``get`` per key.

    :raises StorageError: the backend returned the wrong number of values (or failed).
    """
    # getattr rather than isinstance(storage, SupportsGetMany): a runtime protocol check costs
    # more than the rest of an acquire's Python work.
    get_many = getattr(storage, "get_many", None)
    if not callable(get_many):
        return [storage.get(key) for key in validate_keys(keys)]
    values: list[bytes | None] = get_many(keys)
    if len(values) != len(keys):
        raise StorageError(
            f"get_many() returned {len(values)} values for {len(keys)} keys; the backend breaks "
            f"the Storage contract"
        )
    return values


def validate_scan_ranges(
    ranges: Sequence[ScanRange],
) -> list[tuple[ScanRange, list[tuple[str, str]]]]:
    """Check ``scan_many`` ranges before any I/O; return each with its comparisons.

    :raises TypeError: ``ranges`` is not a list or tuple of :class:`ScanRange`, or a bound is
        not a ``str``.
    :raises ValueError: a prefix or bound is not a storable key, or a limit is not ``None`` or a
        non-negative ``int``.
    """
    if not isinstance(ranges, (list, tuple)):
        raise TypeError(f"scan_many() takes a sequence of ScanRange, got {ranges!r:.80}")
    checked: list[tuple[ScanRange, list[tuple[str, str]]]] = []
    for scan in ranges:
        if not isinstance(scan, ScanRange):
            raise TypeError(f"scan_many() takes ScanRange items, got {scan!r:.80}")
        checked.append(
            (scan, validate_scan_args(scan.prefix, scan.gt, None, None, None, scan.limit))
        )
    return checked


def storage_scan_many(
    storage: Storage, ranges: Sequence[ScanRange]
) -> list[list[tuple[str, bytes]]]:
    """Run the scans of ``ranges``: in one query if the store's class can, else one by one.

    :raises StorageError: the backend returned the wrong number of results (or failed).
    """
    native = getattr(type(storage), "scan_many", None)
    if native is None:
        validate_scan_ranges(ranges)
        return [storage.scan(r.prefix, gt=r.gt, limit=r.limit) for r in ranges]
    results: list[list[tuple[str, bytes]]] = native(storage, ranges)
    if len(results) != len(ranges):
        raise StorageError(
            f"scan_many() returned {len(results)} results for {len(ranges)} ranges; the backend "
            f"breaks the Storage contract"
        )
    return results
