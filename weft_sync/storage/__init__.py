"""Storage: the ``Storage`` protocol, its SQLite and PostgreSQL backends, and ``open_storage``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from ..redaction import redact_url
from .base import (
    Batch,
    Condition,
    Delete,
    Operation,
    Put,
    Storage,
    StorageCapabilities,
    storage_conditional_batch,
    validate_table_name,
)
from .cas import CasRow, SupportsCompareAndSetMany, storage_compare_and_set_many
from .read_then_write import Decide, Decision, SupportsReadThenWrite, storage_read_then_write
from .reads import SupportsGetMany, storage_get_many
from .session_locks import SessionLock, SupportsSessionLocks, storage_session_locks
from .sqlite.store import SqliteStorage
from .wait_bound import SupportsWaitBound

if TYPE_CHECKING:
    from .postgres.store import PostgresStorage

__all__ = [
    "Batch",
    "CasRow",
    "Condition",
    "Decide",
    "Decision",
    "Delete",
    "Operation",
    "PostgresStorage",
    "Put",
    "SessionLock",
    "SqliteStorage",
    "Storage",
    "StorageCapabilities",
    "SupportsCompareAndSetMany",
    "SupportsGetMany",
    "SupportsReadThenWrite",
    "SupportsSessionLocks",
    "SupportsWaitBound",
    "open_storage",
    "storage_compare_and_set_many",
    "storage_conditional_batch",
    "storage_get_many",
    "storage_read_then_write",
    "storage_session_locks",
]

SUPPORTED_SCHEMES = ("sqlite", "postgresql", "postgres")
_SQLITE_PARAMS = ("table", "busy_timeout_ms", "synchronous")
_POSTGRES_PARAMS = (
    "table",
    "min_size",
    "max_size",
    "timeout",
    "renew_interval_ms",
    "statement_timeout",
    "lock_timeout",
    "pooler",
)


def __getattr__(name: str) -> Any:
    # PostgresStorage needs the optional ``postgres`` extra, so it is imported on first use.
    if name == "PostgresStorage":
        from .postgres.store import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_storage(
    url: str, *, read_only: bool = False, renew_interval_ms: int | None = None
) -> Storage:
    """Open the store a URL names.

    - ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``, with optional query
      parameters ``table``, ``busy_timeout_ms`` and ``synchronous`` (``FULL`` or ``NORMAL``);
    - ``postgresql://…`` or ``postgres://…`` (any libpq URL), with optional ``table``,
      ``min_size``, ``max_size``, ``timeout`` (seconds to wait for a pooled connection),
      ``renew_interval_ms``, ``statement_timeout`` and ``lock_timeout`` (seconds, or a duration
      such as ``250ms``; see :class:`~weft_sync.storage.postgres.store.PostgresStorage`) and
      ``pooler`` (``auto``, the default: a transaction-mode pooler such as pgbouncer is
      detected at open; ``transaction``: declared; ``none``, or ``session``: refused when it
      drops the settings); every other query parameter is passed to libpq, percent-encoded as
      libpq decodes it.

    With ``read_only`` the store must already exist and nothing is ever created or written: the
    SQLite file is opened with ``mode=ro`` (no writer thread, no lock file, no table), the
    PostgreSQL table is checked, not created; every write raises
    :class:`~weft_sync.errors.ReadOnlyStorageError`. Error messages show the URL with its
    password masked.

    :param renew_interval_ms: the claim renew interval PostgreSQL's waits are derived from
        (``Ownership.open`` passes its options'); a ``renew_interval_ms`` URL parameter wins.
        SQLite ignores it.
    :raises ValueError: unknown scheme, a missing path, or an unknown or malformed parameter
        (negative, infinite, NaN or not a number), named in the message.
    """
    if not isinstance(url, str):
        raise TypeError(f"open_storage() needs a URL string, got {type(url).__name__} {url!r}")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"unsupported storage URL {redact_url(url)!r}: the scheme must be one of "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)}"
        )
    if scheme.lower() == "sqlite":
        return _open_sqlite(url, read_only)
    return _open_postgres(url, read_only, renew_interval_ms)


def _split_params(
    url: str, query: str, ours: tuple[str, ...], *, pass_through: bool
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    mine: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in ours:
            if key in mine:
                raise ValueError(
                    f"storage URL {redact_url(url)!r} gives the parameter {key!r} twice"
                )
            mine[key] = value
        elif pass_through:
            rest.append((key, value))
        else:
            raise ValueError(
                f"unknown parameter {key!r} in storage URL {redact_url(url)!r}; valid "
                f"parameters are {', '.join(ours)}"
            )
    return mine, rest


def _int_param(url: str, params: dict[str, str], name: str) -> int | None:
    if name not in params:
        return None
    raw = params[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"parameter {name}={raw!r} in storage URL {redact_url(url)!r} must be a whole number"
        ) from None


def _open_sqlite(url: str, read_only: bool) -> Storage:
    rest = url.split("://", 1)[1]
    location, _, query = rest.partition("?")
    if not location.startswith("/"):
        raise ValueError(
            f"storage URL {redact_url(url)!r} names a host; SQLite URLs take a path: "
            f"sqlite:///relative/path.db or sqlite:////absolute/path.db"
        )
    path = location[1:]
    if not path:
        raise ValueError(
            f"storage URL {redact_url(url)!r} has no file path; use sqlite:///relative/path.db or "
            f"sqlite:////absolute/path.db"
        )
    if "\x00" in path:
        raise ValueError(f"storage URL {redact_url(url)!r} has a NUL character in its path")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"storage URL {redact_url(url)!r} has a path that is not valid Unicode"
        ) from None
    params, _ = _split_params(url, query, _SQLITE_PARAMS, pass_through=False)
    kwargs: dict[str, Any] = {}
    if "table" in params:
        kwargs["table"] = validate_table_name(params["table"])
    timeout = _int_param(url, params, "busy_timeout_ms")
    if timeout is not None:
        kwargs["busy_timeout_ms"] = timeout
    if "synchronous" in params:
        kwargs["synchronous"] = params["synchronous"]
    storage: Storage = SqliteStorage(path, read_only=read_only, **kwargs)
    return storage


def _open_postgres(url: str, read_only: bool, renew_interval_ms: int | None) -> Storage:
    from .postgres.settings import (
        check_connect_timeout,
        parse_bound_param,
        parse_seconds_param,
    )

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"malformed storage URL {redact_url(url)!r}: {exc}") from None
    params, rest = _split_params(url, parts.query, _POSTGRES_PARAMS, pass_through=True)
    for key, raw in rest:
        if key == "connect_timeout":
            check_connect_timeout(url, raw)
    # libpq decodes %XX but not "+", so spaces (as in options=-c x=1) must go out as %20.
    query = urlencode(rest, quote_via=quote)
    dsn = urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))
    kwargs: dict[str, Any] = {"renew_interval_ms": renew_interval_ms}
    if "table" in params:
        kwargs["table"] = validate_table_name(params["table"])
    for name in ("min_size", "max_size", "renew_interval_ms"):
        number = _int_param(url, params, name)
        if number is not None:
            kwargs[name] = number
    for name in ("statement_timeout", "lock_timeout"):
        if name in params:
            kwargs[name] = parse_bound_param(url, name, params[name])
    if "timeout" in params:
        kwargs["timeout"] = parse_seconds_param(url, "timeout", params["timeout"])
    from .postgres.store import POOLER_MODES, PostgresStorage

    if "pooler" in params:
        if params["pooler"] not in POOLER_MODES:
            raise ValueError(
                f"parameter pooler={params['pooler']!r} in storage URL {redact_url(url)!r} must "
                f"be one of {', '.join(POOLER_MODES)}"
            )
        kwargs["pooler"] = params["pooler"]

    storage: Storage = PostgresStorage(dsn, read_only=read_only, **kwargs)
    return storage
