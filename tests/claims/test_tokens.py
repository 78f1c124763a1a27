"""Epoch tokens: a number plus a random mint id, never equal for two mintings.

The fences compare the whole epoch value byte for byte, so a store that hands a number out a
second time (after losing writes) still refuses the owner of the first minting.
"""

from __future__ import annotations

import pytest

from tests.claims.gated import new_registry
from weft_sync import keys
from weft_sync.claims.epochs import repair_corrupt_epoch
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.claims.transitions import (
    build_acquire_transition,
    build_external_rotation_transition,
    build_takeover_transition,
    extract_put_value,
)
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    EPOCH_MAX,
    EPOCH_TOKEN_SIZE,
    MINT_ID_SIZE,
    EpochToken,
    decode_epoch,
    decode_token,
    encode_epoch,
    encode_token,
    mint_token,
)
from weft_sync.errors import CorruptEpochError, EpochExhaustedError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

WF = "wf-token"
EPOCH = keys.workflow_owner_epoch(WF)
HOLDER = keys.workflow_owner_holder(WF)


def test_a_token_is_the_epoch_number_followed_by_its_mint_id() -> None:
    token = encode_token(7, b"\x01" * MINT_ID_SIZE)
    assert token == b"\x00" * 7 + b"\x07" + b"\x01" * 8
    assert len(token) == EPOCH_TOKEN_SIZE == 16
    assert decode_epoch(token) == 7
    assert decode_token(token) == EpochToken(7, b"\x01" * 8)


def test_two_mintings_of_one_number_never_give_equal_tokens() -> None:
    tokens = {mint_token(2) for _ in range(1000)}
    assert len(tokens) == 1000
    assert {decode_epoch(t) for t in tokens} == {2}


def test_an_old_format_epoch_decodes_as_a_token_without_mint_id() -> None:
    assert decode_epoch(encode_epoch(5)) == 5
    assert decode_token(encode_epoch(5)) == EpochToken(5, b"")


@pytest.mark.parametrize(
    "value",
    [
        b"",
        encode_epoch(1) + b"\x00",  # 9 bytes
        encode_epoch(1) + b"\x00" * 7,  # 15 bytes
        encode_epoch(1) + b"\x00" * 9,  # 17 bytes
        b"\x00" * 16,  # number 0
        encode_epoch(1)[:0] + b"\xff" * 16,  # beyond the safe range
    ],
)
def test_values_that_are_neither_token_nor_old_epoch_do_not_decode(value: bytes) -> None:
    assert decode_epoch(value) is None
    assert decode_token(value) is None


def test_a_bad_mint_id_is_refused_naming_the_size() -> None:
    with pytest.raises(ValueError, match="8 bytes"):
        encode_token(1, b"short")


def test_every_mint_writes_a_fresh_token_with_the_next_number() -> None:
    old = encode_epoch(41)
    acquire = build_acquire_transition(
        workflow_id=WF, engine_id="e", now=0, claim_ttl_ms=10, observed_epoch_bytes=old
    )
    takeover = build_takeover_transition(
        workflow_id=WF,
        engine_id="e",
        now=0,
        claim_ttl_ms=10,
        observed_holder_bytes=b"x",
        observed_epoch_bytes=old,
    )
    rotation = build_external_rotation_transition(workflow_id=WF, observed_epoch_bytes=old)
    minted = [extract_put_value(f.operations, EPOCH) for f in (acquire, takeover, rotation)]
    assert [len(t) for t in minted] == [EPOCH_TOKEN_SIZE] * 3
    assert [decode_epoch(t) for t in minted] == [42, 42, 42]
    assert len(set(minted)) == 3
    # The conditions still name the exact old-format bytes that were read.
    assert (EPOCH, old) in [(c.key, c.expected) for c in acquire.conditions]


def test_the_last_epoch_is_exhausted_with_the_repair_command_in_the_message() -> None:
    last = mint_token(EPOCH_MAX)
    with pytest.raises(EpochExhaustedError, match="repair-epoch wf-token") as raised:
        build_acquire_transition(
            workflow_id=WF, engine_id="e", now=0, claim_ttl_ms=10, observed_epoch_bytes=last
        )
    assert isinstance(raised.value, CorruptEpochError)
    assert (raised.value.workflow_id, raised.value.key, raised.value.epoch) == (
        WF,
        EPOCH,
        EPOCH_MAX,
    )
    with pytest.raises(EpochExhaustedError):
        build_external_rotation_transition(workflow_id=WF, observed_epoch_bytes=last)


def test_an_exhausted_epoch_is_repaired_to_a_fresh_token_and_can_be_claimed_again(
    storage: Storage,
) -> None:
    clock = ManualClock(1_000_000)
    storage.put(EPOCH, encode_epoch(EPOCH_MAX))
    reg = new_registry(storage, clock, "engine-a")
    try:
        with pytest.raises(EpochExhaustedError):
            reg.acquire(WF)
        repaired = repair_corrupt_epoch(storage, WF, clock=clock)
        stored = storage.get(EPOCH)
        assert decode_epoch(stored) == repaired == 1_000_000 * 1000
        assert stored is not None and len(stored) == EPOCH_TOKEN_SIZE
        assert reg.acquire(WF).epoch == repaired + 1
    finally:
        reg.close()


def test_an_old_format_epoch_stays_valid_until_the_next_mint_upgrades_it(
    storage: Storage,
) -> None:
    clock = ManualClock(1_000_000)
    storage.put(EPOCH, encode_epoch(3))
    reg = new_registry(storage, clock, "engine-a")
    try:
        result = reg.acquire(WF)
        assert result.epoch == 4
        stored = storage.get(EPOCH)
        assert stored is not None and len(stored) == EPOCH_TOKEN_SIZE
        assert result.token == stored == reg.current_epoch_bytes(WF)
    finally:
        reg.close()


def test_a_released_and_reacquired_claim_gets_a_new_number_and_token(
    reg: ClaimRegistry, storage: Storage
) -> None:
    first = reg.acquire(WF)
    reg.release(WF)
    second = reg.acquire(WF)
    assert (first.epoch, second.epoch) == (1, 2)
    assert first.token != second.token
    assert storage.get(EPOCH) == second.token


def test_a_claim_handle_shows_the_number_and_the_token_it_fences_with(
    storage: Storage,
) -> None:
    options = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)
    with Ownership.open(storage, engine_id="engine-a", options=options, background="manual") as own:
        with own.claim(WF) as handle:
            assert handle.epoch == 1
            assert handle.token == storage.get(EPOCH)
            assert decode_token(handle.token) == EpochToken(1, handle.token[8:])
        with own.claim(WF) as again:
            assert again.epoch == 2 and again.token != handle.token
