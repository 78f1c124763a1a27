"""Reading store rows for the read-only commands, so that one bad row cannot hide the others.

A value a foreign writer stored with the wrong type (an SQLite ``INTEGER`` or ``REAL`` where
bytes belong) makes the backend refuse every read that would return it, a scan of many rows
included, and its error names no key. :func:`scan_rows`, :func:`read_value` and
:func:`read_values` read such a row as an :class:`Unreadable` that names its key, and every
other row as usual. A store that fails as a whole (a lost connection, a server gone) still
raises :class:`~weft_sync.errors.StorageError`: a row is reported unreadable only once the
store was seen answering reads that leave it out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from ...errors import StorageError
from ...storage import Storage, storage_get_many
from .output import one_line

SCAN_PAGE: Final = 500
"""Rows read per scan call."""

MAX_LOCATED_KEY: Final = 4096
"""Characters of key the search for an unreadable row tries before it gives up."""

_SURROGATES: Final = 0x800
_CODE_POINTS: Final = 0x110000 - _SURROGATES
"""Characters a key can hold: every code point but the surrogates, which have no UTF-8 form."""


@dataclass(frozen=True)
class Unreadable:
    """A row whose value the store refuses to return.

    :param key: the row's key.
    :param reason: the store's error, on one line.
    """

    key: str
    reason: str


Value = bytes | Unreadable
"""A row's value as the read-only commands read it."""


def read_value(storage: Storage, key: str) -> bytes | Unreadable | None:
    """The value at ``key``: its bytes, ``None`` when absent, or :class:`Unreadable`.

    :raises StorageError: the store does not answer at all.
    """
    try:
        return storage.get(key)
    except StorageError as exc:
        # An empty range reads no row, so only a failing store fails it.
        storage.scan(key, gt=key, lt=key)
        return Unreadable(key, one_line(str(exc)))


def read_values(storage: Storage, keys: Sequence[str]) -> list[bytes | Unreadable | None]:
    """:func:`read_value` of each key, read together while none of them is unreadable."""
    try:
        values: list[bytes | Unreadable | None] = [*storage_get_many(storage, keys)]
    except StorageError:
        return [read_value(storage, key) for key in keys]
    return values


def scan_rows(storage: Storage, prefix: str) -> Iterator[tuple[str, Value]]:
    """Every row whose key starts with ``prefix``, in key order, a page at a time.

    :raises StorageError: the store does not answer at all, or a scan fails for a reason no
        single row explains.
    """
    cursor: str | None = None
    while True:
        try:
            rows = storage.scan(prefix, gt=cursor, limit=SCAN_PAGE)
        except StorageError:
            bad = _locate_unreadable(storage, prefix, cursor)
            if bad is None:
                raise
            # Every row between the cursor and the bad one reads: the search has shown it.
            yield from storage.scan(prefix, gt=cursor, lt=bad.key)
            yield bad.key, bad
            cursor = bad.key
            continue
        yield from rows
        if len(rows) < SCAN_PAGE:
            return
        cursor = rows[-1][0]


def _locate_unreadable(storage: Storage, prefix: str, cursor: str | None) -> Unreadable | None:
    """The first unreadable row after ``cursor``, or ``None`` when no single row explains why
    a scan from there fails.

    Whether a scan of the page after ``cursor`` fails when cut off at key ``X`` only changes
    once, where ``X`` reaches that row's key; the key is found from that, one character at a
    time by bisection. The key found is kept only if reading that row alone fails too.
    """

    def fails(*, lt: str | None = None, lte: str | None = None) -> bool:
        try:
            storage.scan(prefix, gt=cursor, lt=lt, lte=lte, limit=SCAN_PAGE)
        except StorageError:
            return True
        return False

    key = prefix
    while not fails(lte=key):
        if len(key) >= MAX_LOCATED_KEY:
            return None
        # The bad key is longer than ``key`` and starts with it; its next character is the
        # largest ``c`` with no bad row below ``key + c``.
        low, high = 1, _CODE_POINTS
        while high - low > 1:
            middle = (low + high) // 2
            if fails(lt=key + _character(middle)):
                high = middle
            else:
                low = middle
        key += _character(low)
    found = read_value(storage, key)
    return found if isinstance(found, Unreadable) else None


def _character(index: int) -> str:
    """The ``index``-th character in code-point order, surrogates skipped."""
    return chr(index if index < 0xD800 else index + _SURROGATES)


def row_problem(key: str, value: Value, what: str) -> str:
    """What is wrong with a row that does not hold a valid ``what``, naming its key.

    :param what: what the row should hold, e.g. ``"holder record"``.
    """
    if isinstance(value, Unreadable):
        return f"{key!r} cannot be read: {value.reason}"
    size = len(value)
    return f"{key!r} holds {size} byte{'' if size == 1 else 's'}, not a valid {what}"
