"""A corrupt epoch key fails closed: nothing is minted over it until an operator repairs it.

Both backends. A corrupt epoch is written straight into the real store; every path that mints
an epoch (acquire, folded start, takeover, batched takeover, reclaim, external rotation) must
refuse that workflow without writing, and :func:`repair_corrupt_epoch` must write an epoch above
any handed out while deposing the holder.
"""

from __future__ import annotations

import logging

import pytest

from tests.claims.gated import PAST_GRACE_MS, WarningSink, watch_log
from weft_sync import keys
from weft_sync.claims import epochs
from weft_sync.claims.epochs import (
    REPAIR_EPOCHS_PER_MS,
    CorruptEpoch,
    find_corrupt_epochs,
    repair_corrupt_epoch,
)
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.claims.results import TakeoverStatus
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_epoch, decode_holder, encode_epoch
from weft_sync.errors import CorruptEpochError, EngineDeposedError
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Put, Storage
from weft_sync.workflows import Workflows

CORRUPT = b"\x00\x00\x00\x01"  # four bytes: not an 8-byte epoch


def _epoch_key(wid: str) -> str:
    return keys.workflow_owner_epoch(wid)


def _snapshot(storage: Storage, wid: str) -> tuple[bytes | None, bytes | None, bytes | None]:
    return (
        storage.get(_epoch_key(wid)),
        storage.get(keys.workflow_owner_holder(wid)),
        storage.get(keys.workflow(wid)),
    )


def test_acquire_refuses_a_corrupt_epoch_and_writes_nothing(
    reg: ClaimRegistry, storage: Storage
) -> None:
    storage.put(_epoch_key("wf-1"), CORRUPT)
    with (
        watch_log("weft_sync.claims.registry") as log,
        pytest.raises(CorruptEpochError, match="repair_corrupt_epoch") as raised,
    ):
        reg.acquire("wf-1")
    assert raised.value.key == _epoch_key("wf-1")
    assert _snapshot(storage, "wf-1") == (CORRUPT, None, None)
    assert reg.list_held_workflow_ids() == []
    assert any(_epoch_key("wf-1") in m for m in log.messages(logging.WARNING))


def test_start_of_an_id_with_a_corrupt_epoch_writes_nothing(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    workflows = Workflows(reg.storage, reg, clock=clock)
    storage.put(_epoch_key("wf-1"), CORRUPT)
    with pytest.raises(CorruptEpochError):
        workflows.start("wf-1", "job")
    assert _snapshot(storage, "wf-1") == (CORRUPT, None, None)
    assert workflows.list() == []


def test_takeover_refuses_a_corrupt_epoch_behind_an_expired_holder(
    make: object, storage: Storage, clock: ManualClock
) -> None:
    a: ClaimRegistry = make("engine-a")  # type: ignore[operator]
    b: ClaimRegistry = make("engine-b")  # type: ignore[operator]
    for wid in ("wf-1", "wf-2", "wf-3"):
        a.acquire(wid)
    storage.put(_epoch_key("wf-2"), CORRUPT)
    clock.advance(PAST_GRACE_MS)
    before = _snapshot(storage, "wf-2")
    with pytest.raises(CorruptEpochError):
        b.takeover("wf-2")
    outcomes = b.takeover_many(["wf-1", "wf-2", "wf-3"])
    assert isinstance(outcomes[1], CorruptEpochError)
    for outcome in (outcomes[0], outcomes[2]):
        assert not isinstance(outcome, Exception)
        assert outcome.status is TakeoverStatus.ACQUIRED and outcome.epoch == 2
    assert _snapshot(storage, "wf-2") == before
    assert sorted(b.list_held_workflow_ids()) == ["wf-1", "wf-3"]


def test_a_reclaim_pass_skips_the_corrupt_workflow_and_reclaims_the_others(
    storage: Storage, clock: ManualClock
) -> None:
    dead = Ownership.open(storage, clock=clock, background="manual", warn=WarningSink())
    for wid in ("wf-1", "wf-2"):
        dead.workflows.start(wid, "job")
        dead.registry.forget_local_claim(wid)
    dead.close()
    storage.put(_epoch_key("wf-2"), CORRUPT)
    clock.advance(10 * PAST_GRACE_MS)
    reclaimed: list[str] = []
    own = Ownership.open(storage, clock=clock, background="manual", on_reclaimed=reclaimed.append)
    try:
        result = own.run_maintenance()
        assert result.reclaim is not None
        errors = {o.workflow_id: o.error for o in result.reclaim.outcomes if o.error is not None}
        assert isinstance(errors.get("wf-2"), CorruptEpochError)
        assert reclaimed == ["wf-1"]
        assert storage.get(_epoch_key("wf-2")) == CORRUPT
        assert own.registry.current_epoch("wf-1") == 2
    finally:
        own.close()


def test_external_rotation_refuses_a_corrupt_epoch(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    workflows = Workflows(reg.storage, reg, clock=clock)
    workflows.start("wf-1", "job")
    storage.put(_epoch_key("wf-1"), CORRUPT)
    before = _snapshot(storage, "wf-1")
    for rotate in (workflows.cancel, workflows.suspend, workflows.purge):
        with pytest.raises(CorruptEpochError):
            rotate("wf-1")
    assert _snapshot(storage, "wf-1") == before


def test_a_stale_owner_never_passes_the_fence_again_across_a_corrupt_epoch(
    make: object, storage: Storage, clock: ManualClock
) -> None:
    a: ClaimRegistry = make("engine-a", WarningSink())  # type: ignore[operator]
    b: ClaimRegistry = make("engine-b")  # type: ignore[operator]
    stale = Workflows(a.storage, a, clock=clock, warn=WarningSink())
    stale.start("wf-1", "job")
    assert a.current_epoch("wf-1") == 1
    storage.put(_epoch_key("wf-1"), CORRUPT)
    clock.advance(PAST_GRACE_MS)
    # Minting over the corrupt key would hand out epoch 1 again, which A still caches.
    with pytest.raises(CorruptEpochError):
        b.takeover("wf-1")
    epoch = repair_corrupt_epoch(storage, "wf-1", clock=clock)
    assert epoch == clock() * REPAIR_EPOCHS_PER_MS
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    result = b.acquire("wf-1")
    assert result.epoch == epoch + 1
    with pytest.raises(EngineDeposedError):
        stale.save_checkpoint("wf-1", b"late")
    assert decode_epoch(storage.get(_epoch_key("wf-1"))) == epoch + 1


def test_repair_stays_above_the_holder_and_an_operator_bound(storage: Storage) -> None:
    early = ManualClock(5)
    storage.put(_epoch_key("wf-1"), CORRUPT)
    reg = ClaimRegistry(
        storage, engine_id="e", clock=early, claim_ttl_ms=3000, claim_renew_interval_ms=1000
    )
    # A holder written by some engine at a high epoch, then the epoch key corrupted.
    storage.put(_epoch_key("wf-2"), encode_epoch(50_000))
    reg.acquire("wf-2")
    storage.put(_epoch_key("wf-2"), CORRUPT)
    assert repair_corrupt_epoch(storage, "wf-2", clock=early) == 50_002
    assert repair_corrupt_epoch(storage, "wf-1", clock=early, at_least=77_777) == 77_777
    holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-2")))
    assert holder is None


@pytest.mark.parametrize("value", [None, encode_epoch(3)])
def test_repair_refuses_an_epoch_that_is_not_corrupt(storage: Storage, value: bytes | None) -> None:
    if value is not None:
        storage.put(_epoch_key("wf-1"), value)
    with pytest.raises(ValueError, match="wf-owner-epoch:wf-1"):
        repair_corrupt_epoch(storage, "wf-1")
    assert storage.get(_epoch_key("wf-1")) == value


@pytest.mark.parametrize("bound", [0, -1, True, 2**53, "5"])
def test_repair_rejects_a_bad_bound(storage: Storage, bound: object) -> None:
    storage.put(_epoch_key("wf-1"), CORRUPT)
    with pytest.raises(ValueError, match="at_least"):
        repair_corrupt_epoch(storage, "wf-1", at_least=bound)  # type: ignore[arg-type]
    assert storage.get(_epoch_key("wf-1")) == CORRUPT


def test_find_corrupt_epochs_lists_every_corrupt_key_across_pages(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(epochs, "_PAGE", 3)
    for n in range(10):
        storage.put(_epoch_key(f"wf-{n}"), encode_epoch(n + 1))
    bad = {"wf-2": CORRUPT, "wf-5": b"", "wf-9": encode_epoch(1) + b"x", "wf-x/y": b"\x00" * 8}
    for wid, value in bad.items():
        storage.batch([Put(_epoch_key(wid), value)])
    storage.put(keys.workflow_owner_epoch("") + "%E0%A4%A", b"?")
    found = find_corrupt_epochs(storage)
    assert found == sorted(
        [CorruptEpoch(_epoch_key(w), w, len(v)) for w, v in bad.items()]
        + [CorruptEpoch(keys.workflow_owner_epoch("") + "%E0%A4%A", None, 1)],
        key=lambda c: c.key,
    )
    assert find_corrupt_epochs(storage, limit=2) == found[:2]
    with pytest.raises(ValueError, match="limit"):
        find_corrupt_epochs(storage, limit=-1)
