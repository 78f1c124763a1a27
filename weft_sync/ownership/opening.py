"""What ``Ownership.open()`` checks and resolves before it touches a store.

Every argument is validated here, before a URL is opened, so a misconfigured engine fails
without creating a file, a table or a connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..claims.registry import WarnSink
from ..clock import Clock
from ..options import BACKGROUND_MODES, OwnershipOptions
from ..reclaim.fair_share import validate_max_claims
from ..reclaim.target import EligibilityPredicate
from ..storage import Storage, open_storage
from ..tracing import validate_tracing
from .handler_table import Handler, validate_handlers

_log = logging.getLogger("weft_sync.ownership.facade")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The validated ``Ownership.open()`` arguments one engine is built from."""

    options: OwnershipOptions
    clock: Clock
    handlers: Mapping[str, Handler] | None = None
    max_claims: int | None = None
    on_reclaimed: Callable[[str], object] | None = None
    is_eligible: EligibilityPredicate | None = None
    warn: WarnSink | None = None
    engine_id: str | None = None
    tracing: object = False
    background: str = "thread"


def validate_settings(
    *,
    background: str,
    options: OwnershipOptions | None,
    clock: Clock,
    handlers: Mapping[str, Handler] | None,
    max_claims: int | None,
    on_reclaimed: Callable[[str], object] | None,
    is_eligible: EligibilityPredicate | None,
    warn: WarnSink | None,
    engine_id: str | None,
    tracing: object = False,
) -> EngineSettings:
    """Check the arguments of ``Ownership.open()`` (see there); raise naming a bad one.

    :raises ValueError: TypeError: as ``Ownership.open()`` documents.
    """
    if background not in BACKGROUND_MODES:
        raise ValueError(
            f"unknown background={background!r}: use one of "
            f"{', '.join(repr(m) for m in BACKGROUND_MODES)}"
        )
    if options is None:
        options = OwnershipOptions()
    elif not isinstance(options, OwnershipOptions):
        raise TypeError(
            f"options must be an OwnershipOptions, got {type(options).__name__} {options!r}"
        )
    validate_max_claims(max_claims)
    validate_handlers(handlers)
    validate_clock(clock)
    for name, value in (
        ("on_reclaimed", on_reclaimed),
        ("is_eligible", is_eligible),
        ("warn", warn),
    ):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {value!r}")
    return EngineSettings(
        options=options,
        clock=clock,
        handlers=handlers,
        max_claims=max_claims,
        on_reclaimed=on_reclaimed,
        is_eligible=is_eligible,
        warn=warn,
        engine_id=engine_id,
        tracing=validate_tracing(tracing),
        background=background,
    )


def validate_clock(clock: object) -> None:
    """Read ``clock`` once and check that it returns ``int`` milliseconds since the Unix epoch.

    Only the type is checked, before any store is opened; a clock that raises propagates.

    :raises TypeError: ``clock`` is not callable, or it returned something else than an ``int``
        (a ``bool`` included).
    """
    if not callable(clock):
        raise TypeError(f"clock must be callable, got {type(clock).__name__} {clock!r:.80}")
    reading = clock()
    if isinstance(reading, bool) or not isinstance(reading, int):
        # time.time is the likely mistake: it returns float seconds.
        hint = (
            " (time.time returns float seconds: use weft_sync.clock.system_clock, or "
            "lambda: time.time_ns() // 1_000_000)"
            if isinstance(reading, float)
            else ""
        )
        raise TypeError(
            f"clock must return int milliseconds since the Unix epoch, but {clock!r:.80} "
            f"returned {type(reading).__name__} {reading!r:.80}{hint}"
        )


def resolve_storage(url_or_storage: str | Storage, renew_ms: int) -> tuple[Storage, bool]:
    """The store to use, and whether it was opened here (so ``close()`` closes it)."""
    if isinstance(url_or_storage, str):
        # PostgreSQL derives its statement, lock and pool timeouts from the renew interval.
        return open_storage(url_or_storage, renew_interval_ms=renew_ms), True
    if isinstance(url_or_storage, Storage):
        return url_or_storage, False
    raise TypeError(
        f"Ownership.open() needs a storage URL (sqlite:///…, postgresql://…) or a Storage, got "
        f"{type(url_or_storage).__name__} {url_or_storage!r:.80}"
    )


def close_quietly(storage: Storage) -> None:
    """Close a store opened for an ``Ownership`` that failed to open; log, never raise."""
    try:
        storage.close()
    except Exception:
        _log.warning("could not close the store after a failed open", exc_info=True)
