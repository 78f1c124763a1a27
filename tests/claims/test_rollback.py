"""Judging from a failed write's re-read whether the store went back in time."""

from __future__ import annotations

import pytest

from tests.claims.gated import WarningSink, new_registry
from weft_sync import keys
from weft_sync.claims.rollback import describe_store, rollback_evidence
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder, encode_token
from weft_sync.errors import WorkflowClaimLostWarning
from weft_sync.storage import Storage

MINE = encode_token(5, b"\x01" * 8)
HOLDER = encode_holder(HolderRecord("engine-a", 5, 9_000, 1_000))


def _judge(observed_token: bytes | None, observed_holder: bytes | None = None) -> str | None:
    return rollback_evidence(
        engine_id="engine-a",
        held_token=MINE,
        held_holder=HOLDER,
        observed_token=observed_token,
        observed_holder=observed_holder,
    )


@pytest.mark.parametrize(
    ("observed", "words"),
    [
        (None, "epoch key is gone"),
        (encode_token(4, b"\x01" * 8), "from 5 to 4"),
        (encode_epoch(5), "minted a second time"),
        (encode_token(5, b"\x02" * 8), "minted a second time"),
    ],
)
def test_a_lower_or_re_minted_epoch_is_a_rollback(observed: bytes | None, words: str) -> None:
    evidence = _judge(observed)
    assert evidence is not None and words in evidence


@pytest.mark.parametrize("observed", [encode_token(6, b"\x03" * 8), b"\x01\x02"])
def test_a_higher_or_corrupt_epoch_is_no_rollback(observed: bytes) -> None:
    assert _judge(observed) is None


def test_an_older_holder_of_this_engine_under_its_own_token_is_a_rollback() -> None:
    older = encode_holder(HolderRecord("engine-a", 5, 4_000, 1_000))
    evidence = _judge(MINE, older)
    assert evidence is not None and "older" in evidence


@pytest.mark.parametrize(
    "holder",
    [
        None,
        encode_holder(HolderRecord("engine-b", 5, 4_000, 1_000)),
        encode_holder(HolderRecord("engine-a", 5, 12_000, 1_000)),
        b"garbage",
    ],
)
def test_our_token_with_any_other_holder_is_no_rollback(holder: bytes | None) -> None:
    assert _judge(MINE, holder) is None


def test_a_store_is_named_without_its_password() -> None:
    class Store:
        def __repr__(self) -> str:
            return "PostgresStorage('postgresql://weft:s3cret@db/weft')"

    assert describe_store(Store()) == "PostgresStorage('postgresql://weft:***@db/weft')"


def test_a_renewal_that_finds_its_number_re_minted_loses_every_claim_once(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(1_000_000)
    sink = WarningSink()
    reg = new_registry(storage, clock, "engine-a", warn=sink)
    try:
        reg.acquire("x")
        reg.acquire("y")
        # The store forgets x's mint and hands its number out again to another engine.
        storage.put(keys.workflow_owner_epoch("x"), encode_token(1, b"\x09" * 8))
        storage.put(
            keys.workflow_owner_holder("x"),
            encode_holder(HolderRecord("engine-c", 1, clock() + 3_000, clock())),
        )
        with caplog.at_level("WARNING", logger="weft_sync.claims.registry"):
            result = reg.renew("x")
        assert (result.status, result.cause) == ("lost", "store_rollback")
        assert reg.list_held_workflow_ids() == []
        lost = [(w.workflow_id, w.cause) for w in sink.received]
        assert sorted(lost) == [("x", "store_rollback"), ("y", "store_rollback")]
        assert all(isinstance(w, WorkflowClaimLostWarning) for w in sink.received)
        named = [r for r in caplog.records if "went back in time" in r.getMessage()]
        assert len(named) == 1 and "minted a second time" in named[0].getMessage()
        assert repr(storage).split("(")[0] in named[0].getMessage()
    finally:
        reg.close()
