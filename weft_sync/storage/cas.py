"""Compare-and-set of many independent keys: the narrow write renewals need.

A renewal rewrites one key on the condition that it still holds the bytes written last. Through
``conditional_batches`` each of those is a batch of one :class:`~.base.Condition` and one
:class:`~.base.Put`; ``compare_and_set_many`` takes plain ``(key, expected, new)`` rows instead,
which a backend can hand to its driver as they are (SQLite: one ``executemany`` of an ``UPDATE …
WHERE key = ? AND value = ?``; PostgreSQL: one ``UPDATE … FROM unnest(…)``).

The method is optional: :func:`storage_compare_and_set_many` uses it when a backend has it and
falls back to ``conditional_batches`` otherwise, with the same outcome.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

from ..errors import StorageCapabilityError, StorageError
from .base import Batch, Condition, Put, Storage, validate_key

CasRow = tuple[str, bytes, bytes]
"""``(key, expected, new)``: set ``key`` to ``new`` if it holds exactly ``expected``."""

_TUPLE: Final = frozenset([tuple])
_THREE: Final = frozenset([3])
_BYTES: Final = frozenset([bytes])
_KEY: Final = operator.itemgetter(0)
_EXPECTED: Final = operator.itemgetter(1)
_NEW: Final = operator.itemgetter(2)


@runtime_checkable
class SupportsCompareAndSetMany(Protocol):
    """A store with a native ``compare_and_set_many``.

    ``compare_and_set_many(rows)`` applies every ``(key, expected, new)`` row in one transaction,
    in order, each judged against the state the rows before it left: row ``i`` sets ``key`` to
    ``new`` and its result is ``True`` exactly when ``key`` then holds ``expected`` byte for byte
    (an absent key never matches). A row whose condition fails writes nothing; the others are
    unaffected. Bad rows raise ``TypeError``/``ValueError`` before any I/O (see
    :func:`validate_cas_rows`); driver failures raise ``StorageError`` and write nothing.
    """

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]: ...


def _check_row(index: int, row: object) -> CasRow:
    """Return one row with ``bytes`` values, or raise naming it and what a row must be."""
    if not isinstance(row, (tuple, list)) or len(row) != 3:
        raise TypeError(
            f"compare-and-set row {index} must be a (key, expected, new) tuple, got {row!r:.120}"
        )
    key = validate_key(row[0])
    values: list[bytes] = []
    for name, value in (("expected", row[1]), ("new", row[2])):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"compare-and-set row {index} (key {key!r}): {name} must be bytes, got "
                f"{type(value).__name__} {value!r:.80}"
            )
        values.append(bytes(value))
    return key, values[0], values[1]


def validate_cas_rows(rows: Sequence[CasRow]) -> list[CasRow]:
    """Check ``compare_and_set_many`` rows before any I/O; return them as a list of tuples.

    Keys must be storable (see :func:`~.base.validate_key`); values ``bytes`` (a ``bytearray``
    or ``memoryview`` is copied to ``bytes``).

    :raises TypeError: ``rows`` is not a sequence of rows, or a row is not a 3-tuple, or a key
        is not a ``str`` or a value is not bytes-like. The message names the row.
    :raises ValueError: a key is not storable (NUL character, lone surrogate).
    """
    if isinstance(rows, (str, bytes, bytearray, memoryview)) or not isinstance(rows, Sequence):
        raise TypeError(
            f"compare_and_set_many() takes a sequence of (key, expected, new) rows, got "
            f"{type(rows).__name__} {rows!r:.80}"
        )
    checked = rows if type(rows) is list else list(rows)
    # The common case is checked in bulk, column by column (the loops run in C); any doubt goes
    # row by row for a precise message.
    if (
        set(map(type, checked)) <= _TUPLE
        and set(map(len, checked)) <= _THREE
        and set(map(type, map(_EXPECTED, checked))) | set(map(type, map(_NEW, checked))) <= _BYTES
    ):
        try:
            text = "".join(map(_KEY, checked))
            if "\x00" not in text:
                text.encode("utf-8")
                return checked
        except (TypeError, UnicodeEncodeError):
            pass
    return [_check_row(i, row) for i, row in enumerate(checked)]


def cas_batches(rows: Sequence[CasRow]) -> list[Batch]:
    """The ``conditional_batches`` equivalent of ``rows``."""
    return [((Condition(key, expected),), (Put(key, new),)) for key, expected, new in rows]


def storage_compare_and_set_many(storage: Storage, rows: Sequence[CasRow]) -> list[bool]:
    """Apply ``rows`` in one transaction: natively if the store can, else as conditional batches.

    :raises StorageCapabilityError: the backend does not declare ``conditional_batch``.
    :raises StorageError: the backend returned the wrong number of results (or failed).
    """
    if not storage.capabilities.conditional_batch:
        raise StorageCapabilityError("compare_and_set_many", "conditional_batch")
    if isinstance(storage, SupportsCompareAndSetMany):
        results = storage.compare_and_set_many(rows)
        method = "compare_and_set_many"
    else:
        results = storage.conditional_batches(cas_batches(validate_cas_rows(rows)))
        method = "conditional_batches"
    if len(results) != len(rows):
        raise StorageError(
            f"{method}() returned {len(results)} results for {len(rows)} rows; the backend "
            f"breaks the Storage contract"
        )
    return list(map(bool, results))
