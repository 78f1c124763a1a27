"""Reading many keys at once: one query instead of one ``get`` per key.

``get_many(keys)`` is optional on a store: :func:`storage_get_many` uses it when a backend has it
and falls back to one ``get`` per key otherwise, with the same result. The native versions read
every key in one snapshot (one read transaction on SQLite, one statement on PostgreSQL); the
fallback reads them one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import StorageError
from .base import Storage, validate_key

__all__ = ["SupportsGetMany", "storage_get_many", "validate_keys"]


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
    if not isinstance(storage, SupportsGetMany):
        return [storage.get(key) for key in validate_keys(keys)]
    values = storage.get_many(keys)
    if len(values) != len(keys):
        raise StorageError(
            f"get_many() returned {len(values)} values for {len(keys)} keys; the backend breaks "
            f"the Storage contract"
        )
    return values
