"""Ownership options: durations, defaults and the validation rules that keep claims safe."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final, Literal

DEFAULT_CLAIM_TTL_MS: Final = 30_000
DEFAULT_CLAIM_RENEW_INTERVAL_MS: Final = 5_000
DEFAULT_LEASE_TTL_MS: Final = 30_000
DEFAULT_LEASE_RENEW_INTERVAL_MS: Final = 5_000
DEFAULT_LEASE_WAIT_MS: Final = 60_000
TTL_SAFETY_MULTIPLIER: Final = 3

OWNERSHIP_MODES: Final = ("none", "lease", "workflow-lease")
TIME_SOURCES: Final = ("local", "store")
RECLAIM_DISCOVERIES: Final = ("auto", "scan")
BACKGROUND_MODES: Final = ("thread", "manual")

Duration = int | str | timedelta

_UNITS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}
_DURATION = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*(ms|s|m|h)\s*$")
MAX_CLAIM_TTL_MS: Final = 365 * 24 * 3_600_000


def parse_duration(value: Duration) -> int:
    """Return a duration in whole milliseconds.

    Accepts an ``int`` (milliseconds), a :class:`datetime.timedelta`, or a string of a number
    and a unit: ``"500ms"``, ``"30s"``, ``"1.5s"``, ``"2m"``, ``"1h"``.

    :raises ValueError: negative, unitless, fractional milliseconds, or unparseable.
    :raises TypeError: neither an ``int``, a ``timedelta`` nor a ``str``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str, timedelta)):
        raise TypeError(
            f"a duration must be int milliseconds, a datetime.timedelta or a string like "
            f"'30s', got {type(value).__name__} {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value}ms")
        return value
    if isinstance(value, timedelta):
        return _timedelta_ms(value)
    match = _DURATION.match(value)
    if match is None:
        raise ValueError(
            f"invalid duration {value!r}: use a number followed by a unit, one of "
            f"ms, s, m, h (e.g. '500ms', '30s', '2m')"
        )
    number, unit = match.groups()
    scaled = _scale(number, _UNITS[unit])
    if scaled is None:
        raise ValueError(f"invalid duration {value!r}: it is not a whole number of milliseconds")
    return scaled


def _timedelta_ms(value: timedelta) -> int:
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    if micros < 0:
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    if micros % 1_000:
        raise ValueError(f"invalid duration {value!r}: it is not a whole number of milliseconds")
    return micros // 1_000


def _scale(number: str, factor: int) -> int | None:
    whole, _, frac = number.partition(".")
    frac = frac.rstrip("0")
    numerator: int = int(whole + frac) * factor
    denominator: int = 10 ** len(frac)
    if numerator % denominator:
        return None
    return numerator // denominator


def _validate_claim_timing(ttl_ms: int, renew_ms: int) -> None:
    got = f"(got claim_ttl={ttl_ms}ms, claim_renew_interval={renew_ms}ms)"
    if ttl_ms > MAX_CLAIM_TTL_MS:
        raise ValueError(
            f"claim_ttl ({ttl_ms}ms) is longer than the supported maximum of "
            f"{MAX_CLAIM_TTL_MS}ms (365 days)"
        )
    if ttl_ms <= 0 or renew_ms <= 0:
        raise ValueError(
            "ownership: 'workflow-lease' requires positive claim_ttl and "
            f"claim_renew_interval {got}"
        )
    if renew_ms >= ttl_ms:
        raise ValueError(
            f"ownership: 'workflow-lease' requires claim_renew_interval ({renew_ms}ms) to be "
            f"strictly less than claim_ttl ({ttl_ms}ms)"
        )
    if ttl_ms < TTL_SAFETY_MULTIPLIER * renew_ms:
        raise ValueError(
            f"ownership: 'workflow-lease' requires claim_ttl ({ttl_ms}ms) to be at least "
            f"TTL_SAFETY_MULTIPLIER ({TTL_SAFETY_MULTIPLIER}) times claim_renew_interval "
            f"({renew_ms}ms), i.e. at least {TTL_SAFETY_MULTIPLIER * renew_ms}ms, so a claim "
            f"survives two missed renewals"
        )


@dataclass(frozen=True, slots=True)
class OwnershipOptions:
    """Claim timing, validated on construction.

    :param claim_ttl: how long a claim lives without renewal: ``int`` ms, a
        :class:`datetime.timedelta`, or a string such as ``"30s"`` (every duration here takes
        the same three forms; see :func:`parse_duration`).
    :param claim_renew_interval: how often held claims are renewed; at most a third of the TTL.
    :param time_source: the clock holder expiry is written and judged on: ``"store"`` (the
        database server's clock, sampled with round-trip bounds, so host clock skew cannot make
        an engine take over live claims; PostgreSQL only) or ``"local"`` (each engine's own
        ``clock``). ``None``: ``"store"`` on PostgreSQL, ``"local"`` on SQLite (one host) and
        whenever the host passes its own ``clock=`` to ``Ownership.open`` (that clock is then
        claim time).
    :param reclaim_discovery: how reclaim passes find stranded claims: ``"auto"`` reads the
        engine records, the claims of dead engines and bounded rotating windows (cost
        independent of the store's size; a store created before the index is migrated in the
        background and scanned in full meanwhile); ``"scan"`` reads every holder and every
        running workflow on every pass (the fallback, cost linear in the store).
    :param crash_poll_interval: how often a running engine (``background="thread"``) probes
        the other engines' session locks, so that a crashed engine's claims are taken over at
        once instead of after their TTL; ``None`` turns the probe off (crashes are then seen at
        the next reclaim pass, and claims of an engine without a lock after the TTL). Values
        longer than the renew interval are clamped to it.
    :param handler_workers: how many workflow handlers run at once, on the engine's own handler
        threads (never on the maintenance threads, so a slow or hung handler delays no renewal,
        reclaim or poll). Further reclaimed workflows wait in a queue for a free thread.
    :param handler_stuck_after: a handler running longer than this is warned about (once per
        run) and counted in ``weft_workflow_claim_handler_stuck_total{type}``; ``None`` never.
    :param handler_max_attempts: drives of one workflow on this engine that may end without
        finishing it (raised, returned, driver thread gone) before this engine fails it with
        the last error instead of releasing it for another redrive.
    :param on_fork: what an engine with ``background="thread"`` does when its process forks
        (:mod:`weft_sync.ownership.prefork`): ``"stop"`` (default) stops its background maintenance,
        crash probe and handlers in the forking process, with a warning, so a pre-fork master
        drives nothing; ``"continue"`` keeps them running (a host forking helper processes).
        Forks made by the engine's own handler threads never stop it.
    :raises ValueError: a duration is invalid, the pair breaks the safety rules,
        ``time_source`` is not ``"local"``, ``"store"`` or ``None``, ``reclaim_discovery`` is
        not ``"auto"`` or ``"scan"``, or ``crash_poll_interval`` is zero.
    """

    claim_ttl: Duration = "30s"
    claim_renew_interval: Duration = "5s"
    time_source: Literal["local", "store"] | None = None
    reclaim_discovery: Literal["auto", "scan"] = "auto"
    crash_poll_interval: Duration | None = "50ms"
    handler_workers: int = 4
    handler_stuck_after: Duration | None = "5m"
    handler_max_attempts: int = 5
    on_fork: Literal["stop", "continue"] = "stop"
    claim_ttl_ms: int = field(init=False)
    claim_renew_interval_ms: int = field(init=False)
    crash_poll_interval_ms: int | None = field(init=False)
    handler_stuck_after_ms: int | None = field(init=False)

    def __post_init__(self) -> None:
        ttl_ms = parse_duration(self.claim_ttl)
        renew_ms = parse_duration(self.claim_renew_interval)
        _validate_claim_timing(ttl_ms, renew_ms)
        if self.time_source is not None and self.time_source not in TIME_SOURCES:
            raise ValueError(
                f"unknown time_source={self.time_source!r}: use one of "
                f"{', '.join(repr(t) for t in TIME_SOURCES)}, or None for the backend's default "
                f"('store' on PostgreSQL, 'local' on SQLite)"
            )
        if self.reclaim_discovery not in RECLAIM_DISCOVERIES:
            raise ValueError(
                f"unknown reclaim_discovery={self.reclaim_discovery!r}: use one of "
                f"{', '.join(repr(d) for d in RECLAIM_DISCOVERIES)}"
            )
        poll_ms = None
        if self.crash_poll_interval is not None:
            poll_ms = parse_duration(self.crash_poll_interval)
            if poll_ms == 0:
                raise ValueError(
                    f"crash_poll_interval must be more than 0, got "
                    f"{self.crash_poll_interval!r}; use None to turn crash probing off"
                )
            # Probing less often than the reclaim passes run would add nothing.
            poll_ms = min(poll_ms, renew_ms)
        object.__setattr__(self, "claim_ttl_ms", ttl_ms)
        object.__setattr__(self, "claim_renew_interval_ms", renew_ms)
        object.__setattr__(self, "crash_poll_interval_ms", poll_ms)
        _check_positive_int("handler_workers", self.handler_workers)
        _check_positive_int("handler_max_attempts", self.handler_max_attempts)
        stuck_ms = None
        if self.handler_stuck_after is not None:
            stuck_ms = parse_duration(self.handler_stuck_after)
            if stuck_ms == 0:
                raise ValueError(
                    f"handler_stuck_after must be more than 0, got "
                    f"{self.handler_stuck_after!r}; use None to never warn"
                )
        object.__setattr__(self, "handler_stuck_after_ms", stuck_ms)
        if self.on_fork not in ("stop", "continue"):
            raise ValueError(f"on_fork must be 'stop' or 'continue', got {self.on_fork!r}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class OwnershipFields:
    """Resolved ownership configuration of one engine."""

    ownership: Literal["none", "lease", "workflow-lease"]
    lease_ttl_ms: int
    lease_renew_interval_ms: int
    lease_wait_ms: int
    claim_ttl_ms: int
    claim_renew_interval_ms: int
    background: Literal["thread", "manual"]


def resolve_ownership_fields(
    ownership: str = "none",
    *,
    claim_ttl: Duration | None = None,
    claim_renew_interval: Duration | None = None,
    detect_second_instance: bool = False,
    background: str = "thread",
) -> OwnershipFields:
    """Resolve and validate an engine's ownership settings.

    Claim timing is parsed and validated only for ``'workflow-lease'``; other modes get the
    defaults and ignore the given values.

    :raises ValueError: an unknown mode or background setting, invalid claim timing under
        ``'workflow-lease'``, ``detect_second_instance`` with ``'workflow-lease'``, or
        ``background='manual'`` with ``'lease'``.
    """
    if ownership not in OWNERSHIP_MODES:
        raise ValueError(
            f"unknown ownership mode {ownership!r}: use one of "
            f"{', '.join(repr(m) for m in OWNERSHIP_MODES)}"
        )
    if background not in BACKGROUND_MODES:
        raise ValueError(f"unknown background setting {background!r}: use 'thread' or 'manual'")
    ttl_ms, renew_ms = DEFAULT_CLAIM_TTL_MS, DEFAULT_CLAIM_RENEW_INTERVAL_MS
    if ownership == "workflow-lease":
        options = OwnershipOptions(
            claim_ttl=DEFAULT_CLAIM_TTL_MS if claim_ttl is None else claim_ttl,
            claim_renew_interval=(
                DEFAULT_CLAIM_RENEW_INTERVAL_MS
                if claim_renew_interval is None
                else claim_renew_interval
            ),
        )
        ttl_ms, renew_ms = options.claim_ttl_ms, options.claim_renew_interval_ms
        if detect_second_instance:
            raise ValueError(
                "ownership: 'workflow-lease' cannot be combined with detect_second_instance=True: "
                "second-instance detection assumes a single global owner"
            )
    if ownership == "lease" and background == "manual":
        raise ValueError(
            "ownership: 'lease' cannot run with background='manual': the store-wide lease must "
            "be renewed by a background thread; use background='thread' or 'workflow-lease'"
        )
    return OwnershipFields(
        ownership=ownership,  # type: ignore[arg-type]
        lease_ttl_ms=DEFAULT_LEASE_TTL_MS,
        lease_renew_interval_ms=DEFAULT_LEASE_RENEW_INTERVAL_MS,
        lease_wait_ms=DEFAULT_LEASE_WAIT_MS,
        claim_ttl_ms=ttl_ms,
        claim_renew_interval_ms=renew_ms,
        background=background,  # type: ignore[arg-type]
    )
