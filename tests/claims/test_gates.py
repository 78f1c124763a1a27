"""Ownership-mode gates: the capability check and the store-wide mode marker (spec §7.7)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.claims.gated import GatedStorage
from weft_sync import keys
from weft_sync.claims.mode_gates import (
    assert_ownership_mode_marker,
    assert_ownership_storage_capability,
    bootstrap_ownership_gates,
)
from weft_sync.clock import ManualClock
from weft_sync.codec import ModeMarker, decode_mode_marker, encode_mode_marker
from weft_sync.errors import (
    CorruptOwnershipMarkerError,
    OwnershipModeMismatchError,
    StorageCapabilityError,
)
from weft_sync.storage import Storage

MARKER = keys.OWNERSHIP_MODE_MARKER
BAD_MODE: Any = "leases"
CORRUPT = b"\x82\xa4mode\xaabogus-mode\xaeestablished_at\x05"


def test_mode_none_touches_the_store_not_at_all(gated: GatedStorage) -> None:
    bootstrap_ownership_gates(gated, mode="none", clock=ManualClock(1000))
    assert_ownership_storage_capability(gated, "none")
    assert_ownership_mode_marker(gated, mode="none", clock=ManualClock(1000))
    assert gated.total_calls == 0


def test_mode_none_passes_on_a_store_without_compare_and_swap(storage: Storage) -> None:
    bootstrap_ownership_gates(
        GatedStorage(storage, conditional_batch=False), mode="none", clock=ManualClock()
    )
    assert storage.get(MARKER) is None


def test_fresh_store_is_stamped_with_workflow_lease(gated: GatedStorage) -> None:
    bootstrap_ownership_gates(gated, mode="workflow-lease", clock=ManualClock(1000))
    raw = gated.inner.get(MARKER)
    assert decode_mode_marker(raw) == ModeMarker("workflow-lease", 1000)
    assert raw == encode_mode_marker(ModeMarker("workflow-lease", 1000))


@pytest.mark.parametrize("mode", ["lease", "workflow-lease"])
def test_capability_gate_names_the_configured_mode_and_the_capability(
    storage: Storage, mode: str
) -> None:
    cas_less = GatedStorage(storage, conditional_batch=False)
    with pytest.raises(StorageCapabilityError) as caught:
        bootstrap_ownership_gates(cas_less, mode=mode, clock=ManualClock())  # type: ignore[arg-type]
    message = str(caught.value)
    assert "conditional_batch" in message
    assert f"'{mode}'" in message
    assert caught.value.capability == "conditional_batch"
    assert storage.get(MARKER) is None
    assert cas_less.calls["get"] == 0


def test_capability_gate_passes_on_a_compare_and_swap_store(gated: GatedStorage) -> None:
    assert_ownership_storage_capability(gated, "workflow-lease")
    assert gated.total_calls == gated.calls["capabilities"] == 1


def test_fresh_store_is_stamped_with_lease(gated: GatedStorage) -> None:
    assert_ownership_mode_marker(gated, mode="lease", clock=ManualClock(42))
    assert decode_mode_marker(gated.inner.get(MARKER)) == ModeMarker("lease", 42)


def test_matching_marker_passes_and_is_not_rewritten(gated: GatedStorage) -> None:
    original = encode_mode_marker(ModeMarker("workflow-lease", 10))
    gated.inner.put(MARKER, original)
    bootstrap_ownership_gates(gated, mode="workflow-lease", clock=ManualClock(9999))
    assert gated.inner.get(MARKER) == original
    assert gated.transactions == 0


def test_marker_of_the_other_mode_raises_a_mismatch_with_its_fields(storage: Storage) -> None:
    storage.put(MARKER, encode_mode_marker(ModeMarker("lease", 500)))
    with pytest.raises(OwnershipModeMismatchError) as caught:
        bootstrap_ownership_gates(storage, mode="workflow-lease", clock=ManualClock())
    error = caught.value
    assert (error.configured_mode, error.stored_mode, error.established_at) == (
        "workflow-lease",
        "lease",
        500,
    )
    assert decode_mode_marker(storage.get(MARKER)) == ModeMarker("lease", 500)


def test_lost_stamping_race_to_the_same_mode_passes(gated: GatedStorage) -> None:
    winner = encode_mode_marker(ModeMarker("workflow-lease", 3))
    gated.before_next_cas(lambda: gated.inner.put(MARKER, winner))
    assert_ownership_mode_marker(gated, mode="workflow-lease", clock=ManualClock(1000))
    assert gated.inner.get(MARKER) == winner


def test_lost_stamping_race_to_the_other_mode_is_a_mismatch(gated: GatedStorage) -> None:
    winner = encode_mode_marker(ModeMarker("lease", 7))
    gated.before_next_cas(lambda: gated.inner.put(MARKER, winner))
    with pytest.raises(OwnershipModeMismatchError) as caught:
        assert_ownership_mode_marker(gated, mode="workflow-lease", clock=ManualClock(1000))
    assert caught.value.established_at == 7
    assert caught.value.stored_mode == "lease"


def test_marker_vanishing_after_a_lost_race_fails_closed(gated: GatedStorage) -> None:
    gated.force_next_cas(False)
    with pytest.raises(CorruptOwnershipMarkerError, match="absent again"):
        assert_ownership_mode_marker(gated, mode="workflow-lease", clock=ManualClock())
    assert gated.inner.get(MARKER) is None


def test_corrupt_marker_fails_closed_and_is_never_overwritten(gated: GatedStorage) -> None:
    gated.inner.put(MARKER, CORRUPT)
    with pytest.raises(CorruptOwnershipMarkerError, match="does not decode"):
        bootstrap_ownership_gates(gated, mode="workflow-lease", clock=ManualClock())
    assert gated.inner.get(MARKER) == CORRUPT
    assert gated.transactions == 0


def test_corrupt_marker_seen_on_the_post_race_reread_fails_closed(gated: GatedStorage) -> None:
    gated.before_next_cas(lambda: gated.inner.put(MARKER, CORRUPT))
    with pytest.raises(CorruptOwnershipMarkerError, match="does not decode"):
        assert_ownership_mode_marker(gated, mode="lease", clock=ManualClock())
    assert gated.inner.get(MARKER) == CORRUPT


@pytest.mark.parametrize(
    "call",
    [
        lambda s: bootstrap_ownership_gates(s, mode=BAD_MODE, clock=ManualClock()),
        lambda s: assert_ownership_storage_capability(s, BAD_MODE),
        lambda s: assert_ownership_mode_marker(s, mode=BAD_MODE, clock=ManualClock()),
    ],
    ids=["bootstrap", "capability", "marker"],
)
def test_unknown_mode_is_rejected_listing_the_valid_modes(
    gated: GatedStorage, call: object
) -> None:
    with pytest.raises(ValueError, match=r"'leases'.*'none', 'lease', 'workflow-lease'"):
        call(gated)  # type: ignore[operator]
    assert gated.total_calls == 0
