"""The fixed-window takeover cooldown (spec §4.8, §7.5)."""

from __future__ import annotations

import pytest

from weft_sync.claims.cooldown import TakeoverCooldown

W = 5_000


def test_never_deposed_is_inactive() -> None:
    assert not TakeoverCooldown(W).is_active("a", 0)


def test_active_through_the_window_and_inactive_at_its_end() -> None:
    cd = TakeoverCooldown(W)
    cd.record_deposition("a", 100)
    assert cd.is_active("a", 100)
    assert cd.is_active("a", 100 + W - 1)
    assert not cd.is_active("a", 100 + W)
    assert not cd.is_active("a", 100 + 10 * W)


def test_second_deposition_restarts_the_window_without_growing_it() -> None:
    cd = TakeoverCooldown(W)
    cd.record_deposition("a", 0)
    cd.record_deposition("a", 1)
    assert cd.is_active("a", W)
    assert not cd.is_active("a", 1 + W)


def test_clear_ends_the_window_and_is_a_noop_for_unknown_ids() -> None:
    cd = TakeoverCooldown(W)
    cd.record_deposition("a", 0)
    cd.clear("a")
    assert not cd.is_active("a", 1)
    cd.clear("never-seen")
    cd.record_deposition("a", 10)
    assert cd.is_active("a", 10 + W - 1)
    assert not cd.is_active("a", 10 + W)


def test_windows_are_per_workflow() -> None:
    cd = TakeoverCooldown(W)
    cd.record_deposition("a", 0)
    assert not cd.is_active("b", 0)


def test_negative_window_is_rejected() -> None:
    with pytest.raises(ValueError, match="window_ms"):
        TakeoverCooldown(-1)
