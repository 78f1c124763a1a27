"""How long a PostgreSQL call may wait: session timeouts and pool waits derived from claim timing.

A renewal that waits longer than one renew interval makes the next tick skip it, and a claim
whose renewals keep waiting expires in the store while its owner still believes it holds it. So
every wait of :class:`~weft_sync.storage.postgres.store.PostgresStorage` is bounded by the renew
interval unless the caller says otherwise:

- ``statement_timeout``: one renew interval;
- ``lock_timeout``: half a renew interval, at most one second (a row or table lock held by
  another session fails the call instead of stalling it; this store's own transactions hold
  their locks for milliseconds, so a longer wait is someone else's);
- the pool's wait for a connection, and how long the pool retries a lost one before it gives
  it up (a call that then finds the pool empty makes it connect again): one renew interval;
- libpq's ``connect_timeout``: the pool wait rounded up to whole seconds (libpq's minimum is 2).

The server settings are sent as ``-c`` switches in the connection's ``options``, so the server
applies them from the first statement, with no extra round trip. A setting the DSN's own
``options`` (or ``PGOPTIONS``) already makes is left as the caller wrote it. Two more settings
keep the server from ending sessions weft relies on (its lock sessions sit idle by design):

- ``idle_session_timeout = 0`` (PostgreSQL 14 and later), whatever the database or role sets;
- ``idle_in_transaction_session_timeout``: two renew intervals (no transaction of this store
  stays open that long; a longer one is abandoned).

Every connection also gets TCP keepalives and a ``tcp_user_timeout`` of one renew interval,
unless the DSN sets its own (libpq ignores them on Unix sockets), so that a dead peer or a cut
network fails a call instead of blocking it. After connecting, the store reads back what it
set (:func:`expected_settings`, :func:`check_session_settings`): a bound that is not in effect
(a pooler that drops ``options``, a server that refuses one) fails the open, naming it.

Behind a transaction-mode pooler no session setting can be relied on: each transaction may run
on another server session. There the store sends no ``options`` and opens every transaction with
``SET LOCAL`` of ``statement_timeout``, ``lock_timeout`` and
``idle_in_transaction_session_timeout`` (:func:`transaction_settings`), in the same simple query
as its ``BEGIN``; the values are read back inside a transaction at open.
"""

from __future__ import annotations

import enum
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Final

from ...options import parse_duration
from ...redaction import redact_url


class Derived(enum.Enum):
    """The type of :data:`DERIVED`."""

    DERIVED = "derived"


DERIVED: Final = Derived.DERIVED
"""A bound left to be derived from the renew interval (``None`` means no bound)."""

DEFAULT_RENEW_INTERVAL_MS: Final = 5000
"""The renew interval assumed when the storage is opened without one (``OwnershipOptions``'s)."""

# The longest derived lock wait: it also bounds what close() spends on each of its phases.
_MAX_LOCK_TIMEOUT_MS: Final = 1000
# libpq treats a connect_timeout of 1 as 2 seconds.
_MIN_CONNECT_TIMEOUT_S: Final = 2


@dataclass(frozen=True, slots=True)
class WaitBounds:
    """The bounds one storage applies to every wait.

    :param statement_timeout_ms: the server's ``statement_timeout`` (``0``: none).
    :param lock_timeout_ms: the server's ``lock_timeout`` (``0``: none).
    :param pool_timeout_s: how long a call waits for a pooled connection.
    :param idle_in_transaction_ms: the server's ``idle_in_transaction_session_timeout``.
    :param tcp_user_timeout_ms: libpq's ``tcp_user_timeout`` (unacknowledged data on a TCP
        connection fails it after this long).
    """

    statement_timeout_ms: int
    lock_timeout_ms: int
    pool_timeout_s: float
    idle_in_transaction_ms: int = 2 * DEFAULT_RENEW_INTERVAL_MS
    tcp_user_timeout_ms: int = DEFAULT_RENEW_INTERVAL_MS


def _check_ms(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{name} must be a non-negative int of milliseconds (0 disables it), got {value!r}"
        )
    return value


def check_seconds(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite positive number of seconds, else raise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def derive_wait_bounds(
    *,
    renew_interval_ms: int | None,
    statement_timeout_ms: int | None,
    lock_timeout_ms: int | None,
    timeout: float | None,
) -> WaitBounds:
    """Fill in every bound not given from the renew interval (see the module docstring).

    :raises ValueError: a value is negative, not a number, infinite or NaN; the message names it.
    """
    if renew_interval_ms is None:
        interval = DEFAULT_RENEW_INTERVAL_MS
    elif type(renew_interval_ms) is not int or renew_interval_ms <= 0:
        raise ValueError(
            f"renew_interval_ms must be a positive int of milliseconds, got {renew_interval_ms!r}"
        )
    else:
        interval = renew_interval_ms
    statement = interval if statement_timeout_ms is None else statement_timeout_ms
    derived_lock = max(1, min(interval // 2, _MAX_LOCK_TIMEOUT_MS))
    lock = derived_lock if lock_timeout_ms is None else lock_timeout_ms
    pool = interval / 1000.0 if timeout is None else timeout
    return WaitBounds(
        statement_timeout_ms=_check_ms("statement_timeout_ms", statement),
        lock_timeout_ms=_check_ms("lock_timeout_ms", lock),
        pool_timeout_s=check_seconds("timeout", pool),
        idle_in_transaction_ms=2 * interval,
        tcp_user_timeout_ms=interval,
    )


def _sets(options: str, setting: str) -> bool:
    # ``-c name=value``, ``-cname=value`` or ``--name=value``; libpq also accepts ``-`` for ``_``.
    pattern = setting.replace("_", "[_-]")
    return re.search(rf"(?:^|\s)(?:-c\s*|--){pattern}\s*=", options) is not None


# libpq keepalive settings, unless the DSN sets its own: about 11 s of silence ends a connection.
_KEEPALIVES: Final = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


def _own_options(dsn_params: dict[str, Any]) -> str:
    own = dsn_params.get("options")
    return str(own) if own is not None else os.environ.get("PGOPTIONS", "")


def expected_settings(
    dsn_params: dict[str, Any], bounds: WaitBounds, *, idle_session: bool
) -> dict[str, int]:
    """The server settings (in ms, as ``pg_settings`` shows them) this store sets itself.

    A setting the DSN's ``options`` makes is the caller's, and not in the result.

    :param idle_session: whether the server has ``idle_session_timeout`` (PostgreSQL 14+).
    """
    options = _own_options(dsn_params)
    wanted = {
        "statement_timeout": bounds.statement_timeout_ms,
        "lock_timeout": bounds.lock_timeout_ms,
        "idle_in_transaction_session_timeout": bounds.idle_in_transaction_ms,
    }
    if idle_session:
        wanted["idle_session_timeout"] = 0
    return {name: value for name, value in wanted.items() if not _sets(options, name)}


def transaction_settings(bounds: WaitBounds) -> dict[str, int]:
    """The settings (in ms) a store behind a transaction-mode pooler sets with ``SET LOCAL`` at
    the start of each transaction, and reads back at open."""
    return {
        "statement_timeout": bounds.statement_timeout_ms,
        "lock_timeout": bounds.lock_timeout_ms,
        "idle_in_transaction_session_timeout": bounds.idle_in_transaction_ms,
    }


def merged_options(
    dsn_params: dict[str, Any], bounds: WaitBounds, *, idle_session: bool = False
) -> dict[str, Any]:
    """Return the connection keyword arguments that apply ``bounds`` on top of the DSN's own.

    :param dsn_params: the DSN as ``psycopg.conninfo.conninfo_to_dict`` parses it.
    :param idle_session: also send ``idle_session_timeout=0`` (a server of 14 or later).
    """
    kwargs: dict[str, Any] = {"autocommit": True}
    options = _own_options(dsn_params)
    wanted = expected_settings(dsn_params, bounds, idle_session=idle_session)
    extra = [f"-c {name}={value}" for name, value in wanted.items()]
    if extra:
        kwargs["options"] = " ".join([options, *extra]).strip()
    if "connect_timeout" not in dsn_params:
        kwargs["connect_timeout"] = max(_MIN_CONNECT_TIMEOUT_S, math.ceil(bounds.pool_timeout_s))
    kwargs.update({k: v for k, v in _KEEPALIVES.items() if k not in dsn_params})
    if "tcp_user_timeout" not in dsn_params:
        kwargs["tcp_user_timeout"] = bounds.tcp_user_timeout_ms
    return kwargs


def check_session_settings(
    found: dict[str, str], wanted: dict[str, int], where: str, *, per_transaction: bool = False
) -> None:
    """Refuse a session in which a setting this store relies on is not what it set.

    :param found: ``pg_settings`` name -> setting (ms), as read back on the session.
    :param wanted: what :func:`expected_settings` (or :func:`transaction_settings`) says.
    :param where: which session, for the message.
    :param per_transaction: the settings were made with ``SET LOCAL`` in the transaction they
        were read back in, not sent at connect (the message's hint differs).
    :raises ValueError: naming every setting that differs (the caller wraps it).
    """
    wrong = [
        f"{name} is {found[name]} ms, not {value} ms"
        if name in found
        else f"{name} is not reported by the server (wanted {value} ms)"
        for name, value in wanted.items()
        if found.get(name) != str(value)
    ]
    if not wrong:
        return
    if per_transaction:
        hint = (
            "They were set with SET LOCAL in the transaction that read them back, so the server "
            "or a pooler in between overrides them; connect directly, or through a pooler that "
            "leaves a transaction's settings alone"
        )
    else:
        hint = (
            "A connection pooler that drops startup options (pgbouncer with "
            "ignore_startup_parameters = options) or a server that overrides them does this; "
            "connect directly, or add pooler=transaction to the URL"
        )
    raise ValueError(
        f"the {where} does not run with the bounds weft_sync set: {'; '.join(wrong)}. {hint}"
    )


def check_pool_sizes(min_size: object, max_size: object) -> None:
    """Refuse pool sizes that are not ints with ``1 <= min_size <= max_size``."""
    for name, value in (("min_size", min_size), ("max_size", max_size)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(min_size, int) and isinstance(max_size, int)
    if not 1 <= min_size <= max_size:
        raise ValueError(
            f"pool sizes must satisfy 1 <= min_size <= max_size, got min_size={min_size} and "
            f"max_size={max_size}"
        )


def parse_bound_param(url: str, name: str, raw: str) -> float:
    """Parse a URL parameter of seconds (``0.25``) or a duration with a unit (``"250ms"``).

    A plain number is passed on as it is (the constructor refuses one out of range, naming it).

    :raises ValueError: naming the parameter, for anything that is neither.
    """
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return parse_duration(raw) / 1000.0
    except ValueError:
        raise ValueError(
            f"parameter {name}={raw!r} in storage URL {redact_url(url)!r} must be a number of "
            f"seconds or a duration such as '250ms' or '3s'"
        ) from None


def parse_seconds_param(url: str, name: str, raw: str) -> float:
    """Parse a URL parameter of seconds (a positive, finite number).

    :raises ValueError: naming the parameter, for anything else (negative, ``inf``, ``nan``).
    """
    try:
        return check_seconds(name, float(raw))
    except ValueError:
        raise ValueError(
            f"parameter {name}={raw!r} in storage URL {redact_url(url)!r} must be a positive, "
            f"finite number of seconds"
        ) from None


def check_connect_timeout(url: str, raw: str) -> None:
    """Refuse a libpq ``connect_timeout`` that is not a whole number of seconds.

    :raises ValueError: naming the parameter.
    """
    if not raw.strip().isdigit():
        raise ValueError(
            f"parameter connect_timeout={raw!r} in storage URL {redact_url(url)!r} must be a "
            f"whole, non-negative number of seconds"
        )


@dataclass(frozen=True, slots=True)
class ReplicationSettings:
    """What the server says about how durable a commit is once acknowledged.

    An asynchronous standby promoted after a failover may lack the last commits the old primary
    acknowledged, epoch increments among them: a fence handed out before the failover can then be
    handed out again. ``synchronous_commit`` of ``on``/``remote_write``/``remote_apply`` with a
    non-empty ``synchronous_standby_names`` is what rules that out.

    :param synchronous_commit: the session's ``synchronous_commit``.
    :param synchronous_standby_names: the server's ``synchronous_standby_names`` (``""``: none).
    :param is_standby: whether the server is a standby (``pg_is_in_recovery()``).
    :param standbys: standbys streaming from this server now (rows of ``pg_stat_replication``).
    :param sync_standbys: those of them whose ``sync_state`` is ``sync`` or ``quorum``
        (``None`` when the role may not see it: ``pg_read_all_stats`` shows it).
    """

    synchronous_commit: str
    synchronous_standby_names: str
    is_standby: bool
    standbys: int = 0
    sync_standbys: int | None = 0

    @property
    def failover_safe(self) -> bool:
        """Whether an acknowledged commit is on a synchronous standby too."""
        return bool(self.synchronous_standby_names.strip()) and self.synchronous_commit in (
            "on",
            "remote_write",
            "remote_apply",
        )
