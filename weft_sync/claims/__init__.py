"""Claims: pure transitions, the takeover cooldown, the registry, the mode gates, the store
clock and the corrupt-epoch repair."""

from __future__ import annotations

from ..options import OwnershipOptions, parse_duration
from .cooldown import TakeoverCooldown
from .epochs import CorruptEpoch, find_corrupt_epochs, repair_corrupt_epoch
from .mode_gates import (
    OWNERSHIP_MODES,
    OwnershipModeName,
    assert_ownership_mode_marker,
    assert_ownership_storage_capability,
    bootstrap_ownership_gates,
)
from .registry import DEFAULT_RENEW_CHUNK_SIZE, ClaimRegistry, ReleasePreparation, WarnSink
from .renewal_target import ClaimRenewalLostError, RegistryRenewalTarget, create_renewal_target
from .results import (
    AcquirePreparation,
    AcquireResult,
    AcquireStatus,
    ReleaseResult,
    ReleaseStatus,
    RenewResult,
    RenewStatus,
    TakeoverResult,
    TakeoverStatus,
)
from .store_clock import StoreClock
from .transitions import (
    TAKEOVER_GRACE_MULTIPLIER,
    TTL_SAFETY_MULTIPLIER,
    Fragment,
    build_acquire_transition,
    build_external_rotation_transition,
    build_release_transition,
    build_renew_transition,
    build_takeover_transition,
    extract_put_value,
    is_claim_expired,
    next_epoch,
)

__all__ = [
    "AcquirePreparation",
    "AcquireResult",
    "AcquireStatus",
    "ClaimRegistry",
    "ClaimRenewalLostError",
    "CorruptEpoch",
    "DEFAULT_RENEW_CHUNK_SIZE",
    "Fragment",
    "OWNERSHIP_MODES",
    "OwnershipModeName",
    "OwnershipOptions",
    "RegistryRenewalTarget",
    "ReleasePreparation",
    "ReleaseResult",
    "ReleaseStatus",
    "RenewResult",
    "RenewStatus",
    "StoreClock",
    "TAKEOVER_GRACE_MULTIPLIER",
    "TTL_SAFETY_MULTIPLIER",
    "TakeoverCooldown",
    "TakeoverResult",
    "TakeoverStatus",
    "WarnSink",
    "assert_ownership_mode_marker",
    "assert_ownership_storage_capability",
    "bootstrap_ownership_gates",
    "build_acquire_transition",
    "build_external_rotation_transition",
    "build_release_transition",
    "build_renew_transition",
    "build_takeover_transition",
    "create_renewal_target",
    "extract_put_value",
    "find_corrupt_epochs",
    "is_claim_expired",
    "next_epoch",
    "parse_duration",
    "repair_corrupt_epoch",
]
