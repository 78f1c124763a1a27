"""The storage contract every backend implements, and helpers shared by the backends."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from ..errors import StorageCapabilityError

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_SCAN_BOUNDS: Final = (("gt", ">"), ("gte", ">="), ("lt", "<"), ("lte", "<="))


@dataclass(frozen=True, slots=True)
class Condition:
    """``key`` must hold exactly ``expected`` (``None``: the key must be absent)."""

    key: str
    expected: bytes | None


@dataclass(frozen=True, slots=True)
class Put:
    """Write ``value`` at ``key``."""

    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove ``key``; deleting an absent key is a no-op."""

    key: str


Operation = Put | Delete
Batch = tuple[Sequence[Condition], Sequence[Operation]]


@dataclass(frozen=True, slots=True)
class StorageCapabilities:
    """What a backend can promise.

    :param conditional_batch: ``conditional_batch``/``conditional_batches`` compare stored bytes
        exactly (a value-transforming wrapper must report ``False``).
    :param multi_process: several processes on one host may share the store safely.
    :param multi_host: processes on several hosts may share the store safely.
    :param session_locks: the store offers named locks that die with their holder process (see
        :mod:`weft_sync.storage.session_locks`).
    """

    conditional_batch: bool
    multi_process: bool
    multi_host: bool
    session_locks: bool = False


@runtime_checkable
class Storage(Protocol):
    """A byte-valued key-value store with an atomic compare-and-swap.

    Keys are ``str``, values ``bytes``. Every method is safe to call from any thread.

    - ``get(key)`` returns the stored bytes or ``None``.
    - ``put``/``delete`` write one key; deleting an absent key is a no-op.
    - ``scan(prefix, ...)`` returns a snapshot list of ``(key, value)`` pairs whose key starts with
      ``prefix``, in ascending byte order of the UTF-8 key (descending with ``reverse``), further
      bounded by ``gt``/``gte``/``lt``/``lte`` and capped at ``limit`` rows. The list is fully
      materialised, so callers may write while iterating it.
    - ``batch(operations)`` applies the operations all-or-nothing, in order (a later operation on
      the same key wins). An empty list is a no-op.
    - ``conditional_batch(conditions, operations)`` reads every condition key inside one atomic
      transaction; it commits the operations and returns ``True`` only if every condition matches
      (``expected is None`` means the key is absent, otherwise the whole stored value equals
      ``expected`` byte for byte). If any condition fails nothing is written and it returns
      ``False``. An empty condition list always commits. Conditions and operations may name the
      same key.
    - ``conditional_batches(batches)`` applies several independent conditional batches in one
      transaction; batch ``i`` is judged against the state left by batches ``0 .. i-1`` and applied
      on its own, exactly as if they had been committed one after another. Result ``i`` says
      whether batch ``i`` committed.
    - Optionally, ``compare_and_set_many(rows)``: many independent ``(key, expected, new)``
      compare-and-sets in one transaction (see :mod:`weft_sync.storage.cas`); callers go through
      ``storage_compare_and_set_many``, which falls back to ``conditional_batches`` without it.
      Likewise ``get_many(keys)`` (see :mod:`weft_sync.storage.reads`) through
      ``storage_get_many``, which falls back to one ``get`` per key, and
      ``read_then_write(keys, decide)`` (see :mod:`weft_sync.storage.read_then_write`: the read
      and the conditional batch made of it in one transaction, as an acquire needs) through
      ``storage_read_then_write``, which falls back to a read and a ``conditional_batch``.
    - Driver failures raise :class:`~weft_sync.errors.StorageError`, never ``False``; a failed
      transaction writes nothing. Bad arguments raise ``TypeError``/``ValueError`` before any I/O.
    - ``close()`` is idempotent; any other call after it raises
      :class:`~weft_sync.errors.ClosedError`. Storages are context managers that close on exit.
    """

    @property
    def capabilities(self) -> StorageCapabilities: ...

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def scan(
        self,
        prefix: str = "",
        *,
        gt: str | None = None,
        gte: str | None = None,
        lt: str | None = None,
        lte: str | None = None,
        limit: int | None = None,
        reverse: bool = False,
    ) -> list[tuple[str, bytes]]: ...

    def batch(self, operations: Sequence[Operation]) -> None: ...

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool: ...

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Storage: ...

    def __exit__(self, *exc_info: object) -> None: ...


def storage_conditional_batch(
    storage: Storage, conditions: Sequence[Condition], operations: Sequence[Operation]
) -> bool:
    """Run a CAS after checking the backend *declares* the capability (not that a method exists).

    :raises StorageCapabilityError: the backend declares ``conditional_batch=False``.
    :raises TypeError: the backend declares the capability but has no ``conditional_batch``.
    """
    if not storage.capabilities.conditional_batch:
        raise StorageCapabilityError("conditional_batch", "conditional_batch")
    method = getattr(storage, "conditional_batch", None)
    if not callable(method):
        raise TypeError(
            f"{type(storage).__name__} declares the 'conditional_batch' capability but has no "
            f"conditional_batch() method"
        )
    result = method(conditions, operations)
    return bool(result)


def prefix_upper_bound(prefix: str) -> str | None:
    """Return the smallest string above every key starting with ``prefix`` (``None``: no bound).

    The last code point is incremented; an empty prefix has no upper bound.
    """
    if not prefix:
        return None
    last = ord(prefix[-1])
    if last >= 0x10FFFF:
        return prefix_upper_bound(prefix[:-1])
    nxt = last + 1
    if 0xD800 <= nxt <= 0xDFFF:
        nxt = 0xE000
    return prefix[:-1] + chr(nxt)


def validate_table_name(table: object) -> str:
    """Return ``table`` if it is a safe SQL identifier, else raise ``ValueError`` naming it."""
    if not isinstance(table, str) or not _TABLE_NAME.match(table):
        raise ValueError(
            f"invalid table name {table!r}: use 1-63 characters of letters, digits and "
            f"underscores, starting with a letter or underscore"
        )
    if table.lower().startswith(("sqlite_", "pg_")):
        raise ValueError(
            f"invalid table name {table!r}: names starting with 'sqlite_' or 'pg_' are reserved "
            f"by the databases; pick another name"
        )
    return table


def check_batch_shape(item: object) -> tuple[Sequence[Condition], Sequence[Operation]]:
    """Return one ``conditional_batches`` item as ``(conditions, operations)``, or raise naming it.

    A tuple or a list of exactly two sequences is accepted.
    """
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(
            f"each conditional batch must be a (conditions, operations) pair, got {item!r:.120}"
        )
    return item[0], item[1]


def validate_key(key: object) -> str:
    """Return ``key`` if it is a usable storage key, else raise naming it."""
    if not isinstance(key, str):
        raise TypeError(f"storage keys must be str, got {type(key).__name__} {key!r}")
    if "\x00" in key:
        raise ValueError(f"storage key {key!r} contains a NUL character, which cannot be stored")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"storage key {key!r} is not valid Unicode text (lone surrogate at {exc.start})"
        ) from None
    return key


def validate_scan_args(
    prefix: str,
    gt: str | None,
    gte: str | None,
    lt: str | None,
    lte: str | None,
    limit: int | None,
) -> list[tuple[str, str]]:
    """Check ``scan()`` arguments before any I/O; return the comparisons bounding the keys.

    Each item is ``(SQL operator, key)``. With ``key >= prefix`` (left to the caller) they
    select the scanned keys: ``< prefix_upper_bound(prefix)`` when the prefix has an upper bound,
    then each given bound in the order ``gt``, ``gte``, ``lt``, ``lte``.

    :raises TypeError: the prefix or a bound is not a ``str``.
    :raises ValueError: the prefix or a bound is not a storable key, or ``limit`` is not ``None``
        or a non-negative ``int``.
    """
    validate_key(prefix)
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"scan limit must be None or a non-negative int, got {limit!r}")
    comparisons: list[tuple[str, str]] = []
    upper = prefix_upper_bound(prefix)
    if upper is not None:
        comparisons.append(("<", upper))
    for (name, op), bound in zip(_SCAN_BOUNDS, (gt, gte, lt, lte), strict=True):
        if bound is not None:
            try:
                validate_key(bound)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"scan bound {name}: {exc}") from None
            comparisons.append((op, bound))
    return comparisons


def tightest_bounds(prefix: str, comparisons: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The one lower and the at most one upper bound that select what ``key >= prefix`` and
    ``comparisons`` (from :func:`validate_scan_args`) select together.

    For a planner that bounds an index range by one comparison per side, picked without seeing
    the values (SQLite): given ``key >= prefix AND key > cursor`` it may start at the prefix
    and walk every key up to the cursor. Keys compare as ``str`` (code points), which is the
    UTF-8 byte order the backends sort in.
    """
    lower = (">=", prefix)
    upper: tuple[str, str] | None = None
    for op, bound in comparisons:
        if op in (">", ">="):
            if bound > lower[1] or (bound == lower[1] and op == ">"):
                lower = (op, bound)
        elif upper is None or bound < upper[1] or (bound == upper[1] and op == "<"):
            upper = (op, bound)
    return [lower] if upper is None else [lower, upper]


def _validate_value(key: str, value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"the value for key {key!r} must be bytes, got {type(value).__name__} {value!r:.80}"
        )
    return bytes(value)


def validate_operations(operations: Sequence[Operation]) -> list[Operation]:
    """Check every operation before any I/O; return them as a list with ``bytes`` values."""
    checked: list[Operation] = []
    for op in operations:
        if isinstance(op, Put):
            key = validate_key(op.key)
            value = _validate_value(key, op.value)
            checked.append(op if type(op.value) is bytes else Put(key, value))
        elif isinstance(op, Delete):
            validate_key(op.key)
            checked.append(op)
        else:
            raise TypeError(f"expected a Put or Delete operation, got {op!r}")
    return checked


def validate_batch(
    conditions: Sequence[Condition], operations: Sequence[Operation]
) -> tuple[list[Condition], list[Operation]]:
    """Check a conditional batch before any I/O; return it as lists with ``bytes`` values."""
    checked: list[Condition] = []
    for cond in conditions:
        if not isinstance(cond, Condition):
            raise TypeError(f"expected a Condition, got {cond!r}")
        key = validate_key(cond.key)
        if cond.expected is None or type(cond.expected) is bytes:
            checked.append(cond)
        else:
            checked.append(Condition(key, _validate_value(key, cond.expected)))
    return checked, validate_operations(operations)
