"""Result values of the claim registry's operations.

Contention is a value, not an exception: every operation that can lose a race returns one of these
frozen records. ``status`` is a ``str``-valued enum member, so ``result.status == "lost-race"``
holds; fields that do not apply to a status are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .transitions import Fragment


class _StrStatus(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class AcquireStatus(_StrStatus):
    """Outcome of :meth:`~weft_sync.claims.registry.ClaimRegistry.acquire`."""

    ACQUIRED = "acquired"
    LOST_RACE = "lost-race"


class RenewStatus(_StrStatus):
    """Outcome of :meth:`~weft_sync.claims.registry.ClaimRegistry.renew`."""

    RENEWED = "renewed"
    LOST = "lost"
    NOT_HELD = "not-held"


class ReleaseStatus(_StrStatus):
    """Outcome of :meth:`~weft_sync.claims.registry.ClaimRegistry.release`."""

    RELEASED = "released"
    LOST_RACE = "lost-race"
    NOT_HELD = "not-held"


class TakeoverStatus(_StrStatus):
    """Outcome of :meth:`~weft_sync.claims.registry.ClaimRegistry.takeover`."""

    ACQUIRED = "acquired"
    LOST_RACE = "lost-race"
    NOT_EXPIRED = "not-expired"
    NO_CLAIM = "no-claim"
    BACKOFF_SKIPPED = "backoff-skipped"


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """``acquired`` with the new ``epoch`` and its ``token`` (the exact epoch-key bytes the
    fences compare), or ``lost-race`` with the holder's id if known."""

    status: AcquireStatus
    workflow_id: str
    epoch: int | None = None
    held_by: str | None = None
    # Random per minting, so two results of one outcome never compare equal by it.
    token: bytes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RenewResult:
    """``renewed``, ``lost`` or ``not-held`` (nothing to renew).

    ``cause`` is ``None`` except for a claim this engine gave up locally: ``"deadline"`` (no
    renewal succeeded within the local renew deadline) or ``"store_identity"`` (the store was
    replaced). A plain ``lost`` means another writer deposed this engine.
    """

    status: RenewStatus
    workflow_id: str
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """``released``, ``lost-race`` (the claim had already moved on) or ``not-held``."""

    status: ReleaseStatus
    workflow_id: str


@dataclass(frozen=True, slots=True)
class TakeoverResult:
    """Outcome of a takeover attempt.

    ``acquired`` carries ``epoch``, its ``token`` (the exact epoch-key bytes) and the
    ``expires_at`` of the holder it replaced (``None`` when that record did not decode), and
    ``before_expiry`` when that holder had not expired but its engine was named dead (a
    takeover delay, our takeover minus that expiry, means nothing for it); ``lost-race``
    carries ``held_by`` (``None`` if unknown); ``not-expired`` carries ``held_by`` and
    ``expires_at`` of the live holder.
    """

    status: TakeoverStatus
    workflow_id: str
    epoch: int | None = None
    held_by: str | None = None
    expires_at: int | None = None
    before_expiry: bool = False
    # Random per minting, so two results of one outcome never compare equal by it.
    token: bytes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class AcquirePreparation:
    """An acquire fragment to fold into the caller's own atomic write.

    :param fragment: the conditions and operations to add to the caller's batch.
    :param epoch: the epoch the fragment mints.
    :param claimed_at: the ``claimed_at`` time written into the holder.
    """

    fragment: Fragment
    epoch: int
    claimed_at: int
