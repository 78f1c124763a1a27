"""Pure transitions, expiry and put extraction (spec §4, §7.2)."""

from __future__ import annotations

import pytest

from tests.token_match import minted
from weft_sync import keys
from weft_sync.claims.transitions import (
    TAKEOVER_GRACE_MULTIPLIER,
    TTL_SAFETY_MULTIPLIER,
    build_acquire_transition,
    build_external_rotation_transition,
    build_release_transition,
    build_renew_transition,
    build_takeover_transition,
    extract_put_value,
    is_claim_expired,
)
from weft_sync.codec import HolderRecord, decode_holder, encode_epoch, encode_holder
from weft_sync.errors import CorruptEpochError
from weft_sync.storage import Condition, Delete, Put

WF = "wf-1"
EPOCH_KEY = keys.workflow_owner_epoch(WF)
HOLDER_KEY = keys.workflow_owner_holder(WF)


def test_multipliers() -> None:
    assert TTL_SAFETY_MULTIPLIER == 3
    assert TAKEOVER_GRACE_MULTIPLIER == 2


def test_acquire_with_no_epoch_mints_one() -> None:
    frag = build_acquire_transition(
        workflow_id=WF, engine_id="e1", now=1000, claim_ttl_ms=5000, observed_epoch_bytes=None
    )
    assert frag.conditions == (Condition(HOLDER_KEY, None), Condition(EPOCH_KEY, None))
    assert frag.operations == (
        Put(EPOCH_KEY, minted(1)),
        Put(HOLDER_KEY, encode_holder(HolderRecord("e1", 1, 6000, 1000))),
    )


def test_acquire_with_prior_epoch_mints_next() -> None:
    frag = build_acquire_transition(
        workflow_id=WF,
        engine_id="e1",
        now=0,
        claim_ttl_ms=10,
        observed_epoch_bytes=encode_epoch(41),
    )
    assert frag.conditions[1] == Condition(EPOCH_KEY, encode_epoch(41))
    assert frag.operations[0] == Put(EPOCH_KEY, minted(42))
    holder = decode_holder(extract_put_value(frag.operations, HOLDER_KEY))
    assert holder is not None and holder.epoch == 42


@pytest.mark.parametrize(
    "corrupt", [b"\x01\x02\x03", encode_epoch(1) + b"\x00", b"\x00" * 8, b"\xff" * 8]
)
def test_a_corrupt_epoch_is_never_minted_over(corrupt: bytes) -> None:
    with pytest.raises(CorruptEpochError, match="wf-owner-epoch:"):
        build_acquire_transition(
            workflow_id=WF, engine_id="e1", now=0, claim_ttl_ms=10, observed_epoch_bytes=corrupt
        )
    with pytest.raises(CorruptEpochError):
        build_takeover_transition(
            workflow_id=WF,
            engine_id="e1",
            now=0,
            claim_ttl_ms=10,
            observed_holder_bytes=b"garbage",
            observed_epoch_bytes=corrupt,
        )
    with pytest.raises(CorruptEpochError) as raised:
        build_external_rotation_transition(workflow_id=WF, observed_epoch_bytes=corrupt)
    assert raised.value.workflow_id == WF and raised.value.key == EPOCH_KEY


def test_renew_keeps_identity_and_moves_expiry() -> None:
    current = encode_holder(HolderRecord("e1", 5, 1000, 500))
    frag = build_renew_transition(
        workflow_id=WF, now=2000, claim_ttl_ms=3000, current_holder_bytes=current
    )
    assert frag.conditions == (Condition(HOLDER_KEY, current),)
    assert frag.operations == (Put(HOLDER_KEY, encode_holder(HolderRecord("e1", 5, 5000, 500))),)


def test_renew_with_undecodable_holder_raises() -> None:
    with pytest.raises(ValueError, match="did not decode to a valid holder record"):
        build_renew_transition(workflow_id=WF, now=0, claim_ttl_ms=1, current_holder_bytes=b"x")


def test_release_conditions_on_epoch_and_holder_and_deletes_holder_only() -> None:
    holder = encode_holder(HolderRecord("e1", 2, 10, 0))
    frag = build_release_transition(
        workflow_id=WF, current_epoch_bytes=encode_epoch(2), current_holder_bytes=holder
    )
    assert frag.conditions == (Condition(EPOCH_KEY, encode_epoch(2)), Condition(HOLDER_KEY, holder))
    assert frag.operations == (Delete(HOLDER_KEY),)


def test_takeover_follows_the_epoch_key_not_the_holder_claim() -> None:
    stale = encode_holder(HolderRecord("old", 999, 10, 0))
    frag = build_takeover_transition(
        workflow_id=WF,
        engine_id="e2",
        now=3000,
        claim_ttl_ms=6000,
        observed_holder_bytes=stale,
        observed_epoch_bytes=encode_epoch(12),
    )
    assert frag.conditions == (Condition(HOLDER_KEY, stale), Condition(EPOCH_KEY, encode_epoch(12)))
    assert frag.operations == (
        Put(EPOCH_KEY, minted(13)),
        Put(HOLDER_KEY, encode_holder(HolderRecord("e2", 13, 9000, 3000))),
    )


def test_rotation_bumps_epoch_and_deletes_holder() -> None:
    frag = build_external_rotation_transition(workflow_id=WF, observed_epoch_bytes=encode_epoch(4))
    assert frag.conditions == (Condition(EPOCH_KEY, encode_epoch(4)),)
    assert frag.operations == (Put(EPOCH_KEY, minted(5)), Delete(HOLDER_KEY))


def test_rotation_of_never_claimed_workflow_mints_one() -> None:
    frag = build_external_rotation_transition(workflow_id=WF, observed_epoch_bytes=None)
    assert frag.conditions == (Condition(EPOCH_KEY, None),)
    assert frag.operations[0] == Put(EPOCH_KEY, minted(1))


def test_expiry_is_strict_at_the_grace_deadline() -> None:
    assert not is_claim_expired(expires_at=10_000, now=12_000, renew_interval_ms=1_000)
    assert not is_claim_expired(expires_at=10_000, now=11_999, renew_interval_ms=1_000)
    assert is_claim_expired(expires_at=10_000, now=12_001, renew_interval_ms=1_000)


def test_extract_put_value_skips_deletes_and_names_a_missing_key() -> None:
    ops = [Delete("k"), Put("j", b"1"), Put("k", b"2"), Put("k", b"3")]
    assert extract_put_value(ops, "k") == b"2"
    with pytest.raises(ValueError, match='expected a "put" operation for key "z"'):
        extract_put_value([Delete("z")], "z")
