"""The by-engine index entry follows its holder through every claim transition, on both backends.

After each transition the whole store is checked: every decodable holder has exactly its entry
(engine, workflow) -> epoch, and no entry exists without one.
"""

from __future__ import annotations

import pytest

from tests.claims.conftest import Factory
from tests.claims.gated import PAST_GRACE_MS, TTL_MS, GatedStorage, WarningSink
from tests.claims.index_checks import assert_index_exact, entries
from tests.cli.helpers import run_cli
from weft_sync import keys
from weft_sync.claims.epochs import repair_corrupt_epoch
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder
from weft_sync.errors import WorkflowClaimLostWarning
from weft_sync.storage import Put, Storage
from weft_sync.workflows import Workflows

WF = "wf/1"
HOLDER = keys.workflow_owner_holder(WF)
EPOCH = keys.workflow_owner_epoch(WF)


def entry(engine_id: str, workflow_id: str = WF) -> str:
    return keys.workflow_owner_by_engine(engine_id, workflow_id)


# -- keys ----------------------------------------------------------------------------------------


def test_entry_keys_encode_both_ids_and_decode_only_canonical_keys() -> None:
    key = keys.workflow_owner_by_engine("host:1/a", "wf 1")
    assert key == "wf-owner-by-engine:host%3A1%2Fa:wf%201"
    assert keys.workflow_owner_by_engine_prefix("host:1/a") == "wf-owner-by-engine:host%3A1%2Fa:"
    assert key.startswith(keys.workflow_owner_by_engine_prefix("host:1/a"))
    assert keys.workflow_owner_by_engine_prefix("") == "wf-owner-by-engine:"
    assert keys.decode_owner_by_engine_key(key) == ("host:1/a", "wf 1")
    assert keys.OWNER_INDEX_MARKER == "wf-owner-index-marker"


@pytest.mark.parametrize(
    "key",
    [
        "wf-owner-by-engine:e",  # no workflow component
        "wf-owner-by-engine:e:",  # empty workflow id
        "wf-owner-by-engine::w",  # empty engine id
        "wf-owner-by-engine:e:w:x",  # a third component
        "wf-owner-by-engine:e:%zz",  # malformed escape
        "wf-owner-by-engine:e:%61",  # non-canonical escape of "a"
        "wf-owner-by-engine:e%3a1:w",  # lowercase hex is not canonical
        "wf-owner-holder:w",
    ],
)
def test_non_canonical_entry_keys_do_not_decode(key: str) -> None:
    assert keys.decode_owner_by_engine_key(key) is None


# -- the registry's own transitions --------------------------------------------------------------


def test_acquire_writes_the_entry_and_renewal_leaves_it(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    assert reg.acquire(WF).status == "acquired"
    assert entries(gated) == {("engine-a", WF): 1}
    before = gated.get(HOLDER)
    clock.advance(1_000)
    assert reg.renew(WF).status == "renewed"
    assert gated.get(HOLDER) != before
    assert entries(gated) == {("engine-a", WF): 1}
    assert_index_exact(gated)


def test_renewal_writes_only_the_holder(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    seen: list[set[str]] = []

    def record(batches: object) -> bool:
        seen.append({op.key for _, operations in batches for op in operations})  # type: ignore[attr-defined]
        return True

    gated.intercept_next_cas(match=record)  # observes the renewal's CAS and lets it commit
    clock.advance(1_000)
    assert reg.renew_many([WF])[0].status == "renewed"
    assert seen == [{HOLDER}]


def test_release_deletes_the_entry(reg: ClaimRegistry, gated: GatedStorage) -> None:
    reg.acquire(WF)
    assert reg.release(WF).status == "released"
    assert entries(gated) == {}
    assert_index_exact(gated)


def test_release_all_at_close_deletes_every_entry(reg: ClaimRegistry, gated: GatedStorage) -> None:
    for n in range(5):
        reg.acquire(f"wf-{n}")
    reg.close()
    assert entries(gated) == {}
    assert_index_exact(gated)


def test_takeover_by_another_engine_moves_the_entry(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    other = make("engine-b")
    clock.advance(PAST_GRACE_MS)
    assert other.takeover(WF).status == "acquired"
    assert entries(gated) == {("engine-b", WF): 2}
    assert_index_exact(gated)


def test_takeover_by_the_same_engine_overwrites_its_entry(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    restarted = make("engine-a")  # the same engine id in a new registry (a restarted process)
    clock.advance(PAST_GRACE_MS)
    assert restarted.takeover(WF).status == "acquired"
    assert entries(gated) == {("engine-a", WF): 2}
    assert_index_exact(gated)


def test_takeover_many_moves_every_entry_of_the_chunk(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    ids = [f"wf-{n}" for n in range(7)]
    for wid in ids:
        reg.acquire(wid)
    other = make("engine-b")
    clock.advance(PAST_GRACE_MS)
    results = other.takeover_many(ids, chunk_size=3)
    assert [getattr(r, "status", r) for r in results] == ["acquired"] * len(ids)
    assert entries(gated) == {("engine-b", wid): 2 for wid in ids}
    assert_index_exact(gated)


def test_takeover_of_a_garbage_holder_writes_only_the_new_entry(
    make: Factory, gated: GatedStorage
) -> None:
    gated.batch([Put(EPOCH, encode_epoch(4)), Put(HOLDER, b"\xc1 not msgpack")])
    assert make("engine-b").takeover(WF).status == "acquired"
    assert entries(gated) == {("engine-b", WF): 5}
    assert_index_exact(gated)


def test_takeover_entry_follows_the_epoch_key_not_the_holder_field(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    stale = encode_holder(HolderRecord("engine-x", 999, 0, 0))
    gated.batch([Put(EPOCH, encode_epoch(12)), Put(HOLDER, stale), Put(entry("engine-x"), b"x")])
    clock.advance(PAST_GRACE_MS)
    assert make("engine-b").takeover(WF).status == "acquired"
    assert entries(gated) == {("engine-b", WF): 13}


# -- dead engines --------------------------------------------------------------------------------


def test_a_dead_engines_unexpired_claim_is_taken_at_once(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage
) -> None:
    reg.acquire(WF)
    other = make("engine-b")
    assert other.takeover(WF).status == "not-expired"
    result = other.takeover(WF, dead_engines={"engine-a"})
    assert (result.status, result.epoch, result.before_expiry) == ("acquired", 2, True)
    assert entries(gated) == {("engine-b", WF): 2}
    assert_index_exact(gated)


def test_the_deposed_engine_can_no_longer_renew_after_a_dead_engine_takeover(
    reg: ClaimRegistry, make: Factory, sink: WarningSink
) -> None:
    reg.acquire(WF)
    make("engine-b").takeover(WF, dead_engines=["engine-a"])
    assert reg.renew(WF).status == "lost"
    assert sink.lost_ids() == [WF]
    assert reg.current_epoch(WF) is None


def test_an_engine_not_named_dead_keeps_its_unexpired_claim(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage
) -> None:
    reg.acquire(WF)
    other = make("engine-b")
    result = other.takeover(WF, dead_engines={"engine-c"})
    assert (result.status, result.held_by) == ("not-expired", "engine-a")
    (many,) = other.takeover_many([WF], dead_engines={"engine-c"})
    assert getattr(many, "status", many) == "not-expired"
    assert entries(gated) == {("engine-a", WF): 1}


def test_an_engine_never_takes_its_own_claim_by_naming_itself_dead(
    reg: ClaimRegistry, make: Factory
) -> None:
    reg.acquire(WF)
    restarted = make("engine-a")
    result = restarted.takeover(WF, dead_engines={"engine-a"})
    assert (result.status, result.held_by) == ("not-expired", "engine-a")
    assert reg.current_epoch(WF) == 1


def test_an_expired_claim_taken_with_dead_engines_is_not_before_expiry(
    reg: ClaimRegistry, make: Factory, clock: ManualClock
) -> None:
    reg.acquire(WF)
    clock.advance(PAST_GRACE_MS)
    result = make("engine-b").takeover(WF, dead_engines={"engine-a"})
    assert (result.status, result.before_expiry) == ("acquired", False)
    assert result.expires_at == 1_000 + TTL_MS


def test_a_holder_that_changed_since_the_read_loses_the_dead_engine_takeover(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    other = make("engine-b")
    clock.advance(1_000)
    # The "dead" engine renews between the takeover's read and its commit.
    gated.before_next_cas(lambda: reg.renew(WF))
    result = other.takeover(WF, dead_engines={"engine-a"})
    assert (result.status, result.held_by) == ("lost-race", "engine-a")
    assert reg.current_epoch(WF) == 1
    assert entries(gated) == {("engine-a", WF): 1}
    assert_index_exact(gated)


def test_takeover_many_takes_only_the_dead_engines_claims(
    make: Factory, gated: GatedStorage
) -> None:
    dead, alive, taker = make("engine-dead"), make("engine-alive"), make("engine-b")
    for n in range(4):
        dead.acquire(f"d-{n}")
        alive.acquire(f"a-{n}")
    ids = [f"{p}-{n}" for n in range(4) for p in ("d", "a")]
    results = taker.takeover_many(ids, dead_engines=frozenset({"engine-dead"}), chunk_size=3)
    statuses = {r.workflow_id: r.status for r in results if not isinstance(r, Exception)}
    assert statuses == {wid: "acquired" if wid[0] == "d" else "not-expired" for wid in ids}
    assert {k for k, v in entries(gated).items()} == {
        *(("engine-b", f"d-{n}") for n in range(4)),
        *(("engine-alive", f"a-{n}") for n in range(4)),
    }
    assert_index_exact(gated)


def test_the_cooldown_still_applies_to_a_dead_engine_takeover(
    reg: ClaimRegistry, make: Factory, clock: ManualClock, sink: WarningSink
) -> None:
    reg.acquire(WF)
    other = make("engine-b")
    other.takeover(WF, dead_engines={"engine-a"})
    # engine-a learns it lost the claim: its cooldown for WF starts.
    assert reg.renew(WF).status == "lost"
    result = reg.takeover(WF, dead_engines={"engine-b"})
    assert result.status == "backoff-skipped"


@pytest.mark.parametrize("bad", ["engine-a", b"engine-a"])
def test_dead_engines_must_be_a_collection_not_one_id(reg: ClaimRegistry, bad: object) -> None:
    with pytest.raises(TypeError, match="dead_engines must be a collection of engine ids"):
        reg.takeover(WF, dead_engines=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dead_engines must be a collection"):
        reg.takeover_many([WF], dead_engines=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", 7, None])
def test_dead_engines_must_hold_non_empty_ids(reg: ClaimRegistry, bad: object) -> None:
    with pytest.raises(ValueError, match=f"non-empty str engine ids, got {bad!r}"):
        reg.takeover(WF, dead_engines=[bad])  # type: ignore[list-item]


# -- the ledger: folded acquire and release, external rotation ------------------------------------


@pytest.fixture
def ledger(reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock) -> Workflows:
    return Workflows(gated, reg, clock=clock, warn=WarningSink())


@pytest.fixture
def outsider(gated: GatedStorage, clock: ManualClock) -> Workflows:
    return Workflows(gated, None, clock=clock, warn=WarningSink())


def test_start_folds_the_entry_into_its_create_write(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    assert entries(gated) == {("engine-a", WF): 1}
    assert_index_exact(gated)


@pytest.mark.parametrize("finish", ["complete", "fail"])
def test_complete_and_fail_delete_the_entry_with_the_release(
    ledger: Workflows, gated: GatedStorage, finish: str
) -> None:
    ledger.start(WF, "import")
    if finish == "complete":
        ledger.complete(WF, {"rows": 3})
    else:
        ledger.fail(WF, "bank said no")
    assert gated.get(HOLDER) is None
    assert entries(gated) == {}
    assert_index_exact(gated)


@pytest.mark.parametrize("operation", ["cancel", "timeout", "suspend", "purge"])
def test_external_rotation_deletes_the_deposed_owners_entry(
    ledger: Workflows, outsider: Workflows, gated: GatedStorage, operation: str
) -> None:
    ledger.start(WF, "import")
    getattr(outsider, operation)(WF)
    assert gated.get(HOLDER) is None
    assert entries(gated) == {}
    assert_index_exact(gated)


def test_external_rotation_of_an_unheld_workflow_deletes_nothing_else(
    ledger: Workflows, outsider: Workflows, gated: GatedStorage, make: Factory
) -> None:
    ledger.start(WF, "import")
    ledger.suspend(WF)  # rotates and releases: no holder, no entry
    make("engine-b").acquire("other")
    outsider.cancel(WF)
    assert entries(gated) == {("engine-b", "other"): 1}
    assert_index_exact(gated)


def test_resume_after_suspend_writes_the_entry_again(
    ledger: Workflows, outsider: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    outsider.suspend(WF)
    ledger.resume(WF)
    assert entries(gated) == {("engine-a", WF): 3}
    assert_index_exact(gated)


# -- the command line and the epoch repair -------------------------------------------------------


def test_cli_cancel_and_release_delete_the_entry(storage_url: str, storage: Storage) -> None:
    from weft_sync import Ownership

    with Ownership.open(storage_url, background="manual", engine_id="engine-a") as engine:
        engine.workflows.start("job", "import")
        assert engine.registry.acquire("lock").status == "acquired"
        assert entries(storage) == {("engine-a", "job"): 1, ("engine-a", "lock"): 1}
        assert run_cli("--url", storage_url, "cancel", "job")[0] == 0
        assert run_cli("--url", storage_url, "release", "lock")[0] == 0
        assert entries(storage) == {}
        assert_index_exact(storage)
        with pytest.warns(WorkflowClaimLostWarning):
            engine.registry.renew_many(["job", "lock"])


def test_repair_of_a_corrupt_epoch_deletes_the_deposed_holders_entry(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    gated.put(EPOCH, b"corrupt")
    repair_corrupt_epoch(gated, WF, clock=clock)
    assert gated.get(HOLDER) is None
    assert entries(gated) == {}
    assert_index_exact(gated)
