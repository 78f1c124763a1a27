"""Batched takeover: ``takeover_many`` gives each id what ``takeover`` would, a chunk at a time."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.claims.gated import (
    PAST_GRACE_MS,
    RENEW_MS,
    START_MS,
    TTL_MS,
    BatchesOnly,
    GatedStorage,
    WarningSink,
    new_registry,
    touches,
)
from tests.token_match import epoch_numbers, minted, token_shape
from weft_sync import keys
from weft_sync.claims.registry import DEFAULT_TAKEOVER_CHUNK_SIZE, ClaimRegistry
from weft_sync.claims.results import TakeoverResult, TakeoverStatus
from weft_sync.claims.transitions import build_external_rotation_transition
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, decode_holder, encode_epoch, encode_holder
from weft_sync.errors import StorageCapabilityError, StorageError
from weft_sync.storage import SqliteStorage, Storage
from weft_sync.storage.base import Batch
from weft_sync.storage.reads import storage_get_many

Factory = Callable[..., ClaimRegistry]
GARBAGE = b"\x92 not a holder"


class ReadCountingStorage(GatedStorage):
    """A gated store with a native ``get_many`` that records every key list it reads.

    ``fail_next_read_of(key, error)`` makes the next ``get_many`` naming ``key`` raise ``error``
    without reading. ``batch_sizes`` records how many batches each ``conditional_batches`` held.
    """

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        # _reads_lock guards reads, batch_sizes and _read_failures.
        self._reads_lock = threading.Lock()
        self.reads: list[list[str]] = []
        self.batch_sizes: list[int] = []
        self._read_failures: dict[str, BaseException] = {}

    def fail_next_read_of(self, key: str, error: BaseException) -> None:
        with self._reads_lock:
            self._read_failures[key] = error

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._count("get_many")
        with self._reads_lock:
            self.reads.append(list(keys))
            error = next(
                (self._read_failures.pop(k) for k in keys if k in self._read_failures), None
            )
        if error is not None:
            raise error
        return storage_get_many(self.inner, keys)

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        with self._reads_lock:
            self.batch_sizes.append(len(batches))
        return super().conditional_batches(batches)

    def keys_read(self) -> set[str]:
        with self._reads_lock:
            return {key for keys_ in self.reads for key in keys_}


@pytest.fixture
def gated(storage: Storage) -> ReadCountingStorage:
    return ReadCountingStorage(storage)


@pytest.fixture
def rival(make: Factory, storage: Storage) -> ClaimRegistry:
    """Engine B, writing to the store directly (never through A's intercepts)."""
    return make("engine-b", WarningSink(), store=storage)


def _holder(storage: Storage, wid: str) -> HolderRecord | None:
    return decode_holder(storage.get(keys.workflow_owner_holder(wid)))


def _claim_keys(wid: str) -> set[str]:
    return {keys.workflow_owner_holder(wid), keys.workflow_owner_epoch(wid)}


def _statuses(outcomes: Sequence[TakeoverResult | Exception]) -> list[str | None]:
    return [o.status.value if isinstance(o, TakeoverResult) else None for o in outcomes]


def _expiry(storage: Storage, workflow_id: str) -> int:
    """The expiry of the holder stored for ``workflow_id`` right now."""
    holder = _holder(storage, workflow_id)
    assert holder is not None
    return holder.expires_at


def _expired(rival: ClaimRegistry, clock: ManualClock, *ids: str) -> None:
    """Let ``rival`` claim ``ids`` and then let those claims expire past their grace."""
    for wid in ids:
        assert rival.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)


# -- each id's outcome ----------------------------------------------------------------------


def test_each_id_gets_the_outcome_takeover_would_give_it(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "expired")
    rival.acquire("live")
    storage.put(keys.workflow_owner_holder("garbage"), GARBAGE)
    storage.put(keys.workflow_owner_epoch("garbage"), encode_epoch(4))
    storage.put(keys.workflow_owner_holder("no-epoch"), encode_holder(HolderRecord("x", 1, 0, 0)))
    ids = ["expired", "live", "absent", "no-epoch", "garbage"]
    replaced = _expiry(storage, "expired")

    outcomes = reg.takeover_many(ids)

    assert outcomes == [
        # An acquired result carries the replaced holder's expiry (none for garbage).
        TakeoverResult(TakeoverStatus.ACQUIRED, "expired", epoch=2, expires_at=replaced),
        TakeoverResult(
            TakeoverStatus.NOT_EXPIRED, "live", held_by="engine-b", expires_at=clock() + TTL_MS
        ),
        TakeoverResult(TakeoverStatus.NO_CLAIM, "absent"),
        TakeoverResult(TakeoverStatus.NO_CLAIM, "no-epoch"),
        TakeoverResult(TakeoverStatus.ACQUIRED, "garbage", epoch=5),
    ]
    assert _holder(storage, "expired") == HolderRecord("engine-a", 2, clock() + TTL_MS, clock())
    assert _holder(storage, "garbage") == HolderRecord("engine-a", 5, clock() + TTL_MS, clock())
    assert storage.get(keys.workflow_owner_epoch("garbage")) == minted(5)
    assert sorted(reg.list_held_workflow_ids()) == ["expired", "garbage"]
    assert (reg.current_epoch("expired"), reg.current_epoch("garbage")) == (2, 5)
    assert reg.current_epoch_bytes("expired") == storage.get(keys.workflow_owner_epoch("expired"))
    assert reg.current_epoch("live") is None
    assert storage.get(keys.workflow_owner_epoch("no-epoch")) is None
    # One read and one transaction for the whole chunk, no single reads.
    assert len(gated.reads) == 1
    assert gated.batch_sizes == [2]
    assert gated.calls["get"] == 0
    # The tracked holder bytes are the ones written: renew and release condition on them.
    clock.advance(RENEW_MS)
    assert reg.renew("expired").status == "renewed"
    assert reg.release("garbage").status == "released"
    assert _holder(storage, "garbage") is None


def test_takeover_many_of_this_engines_own_live_claim_is_not_expired(
    reg: ClaimRegistry, gated: ReadCountingStorage
) -> None:
    reg.acquire("mine")
    transactions = gated.transactions
    (outcome,) = reg.takeover_many(["mine"])
    assert outcome == TakeoverResult(
        TakeoverStatus.NOT_EXPIRED, "mine", held_by="engine-a", expires_at=START_MS + TTL_MS
    )
    assert gated.transactions == transactions
    assert reg.current_epoch("mine") == 1


def test_takeover_many_writes_every_holder_from_one_clock_reading(
    gated: ReadCountingStorage, rival: ClaimRegistry, clock: ManualClock, storage: Storage
) -> None:
    _expired(rival, clock, "a", "b", "c")
    readings: list[int] = []

    def ticking() -> int:
        readings.append(clock())
        clock.advance(1)
        return readings[-1]

    reg = new_registry(gated, ticking)
    outcomes = reg.takeover_many(["a", "b", "c"], chunk_size=1)
    assert _statuses(outcomes) == ["acquired"] * 3
    # One reading judges and stamps the whole call; one more after each chunk's commit checks
    # that the commit did not stall (it did not: nothing is renewed).
    assert len(readings) == 1 + 3
    assert {_holder(storage, w) for w in "abc"} == {
        HolderRecord("engine-a", 2, readings[0] + TTL_MS, readings[0])
    }


# -- cooldown ---------------------------------------------------------------------------------


def _deposed(reg: ClaimRegistry, rival: ClaimRegistry, clock: ManualClock, wid: str) -> None:
    """Let ``rival`` take ``wid`` from ``reg`` and ``reg`` notice it: the cooldown starts now.

    The rival's own claim is left expired too, so only the cooldown stops a takeover.
    """
    assert reg.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)
    assert rival.takeover(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)
    assert reg.renew(wid).status == "lost"


def test_an_id_in_this_engines_cooldown_is_backoff_skipped_without_reads(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    rival.acquire("other")  # expired by the time the deposition is noticed
    _deposed(reg, rival, clock, "lost")
    lost_holder = storage.get(keys.workflow_owner_holder("lost"))
    gated.reads.clear()
    replaced = _expiry(storage, "other")

    outcomes = reg.takeover_many(["lost", "other"])

    assert outcomes == [
        TakeoverResult(TakeoverStatus.BACKOFF_SKIPPED, "lost"),
        TakeoverResult(TakeoverStatus.ACQUIRED, "other", epoch=2, expires_at=replaced),
    ]
    assert gated.keys_read() == _claim_keys("other")
    assert gated.batch_sizes[-1] == 1
    assert storage.get(keys.workflow_owner_holder("lost")) == lost_holder
    assert reg.list_held_workflow_ids() == ["other"]
    assert sink.lost_ids() == ["lost"]


def test_takeover_many_of_only_cooled_down_ids_touches_no_storage(
    reg: ClaimRegistry, rival: ClaimRegistry, gated: ReadCountingStorage, clock: ManualClock
) -> None:
    _deposed(reg, rival, clock, "lost")
    before = gated.total_calls
    assert _statuses(reg.takeover_many(["lost", "lost"])) == ["backoff-skipped"] * 2
    assert gated.total_calls == before
    clock.advance(RENEW_MS - 1)
    assert _statuses(reg.takeover_many(["lost"])) == ["backoff-skipped"]
    clock.advance(1)  # the window's end instant is outside it
    replaced = _expiry(gated.inner, "lost")
    (outcome,) = reg.takeover_many(["lost"])
    assert outcome == TakeoverResult(TakeoverStatus.ACQUIRED, "lost", epoch=3, expires_at=replaced)
    assert reg.current_epoch("lost") == 3


# -- races ----------------------------------------------------------------------------------


def test_a_lost_race_names_the_winner_and_the_rest_of_the_chunk_still_commits(
    make: Factory,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "raced", "free")
    competitor = make("engine-c", WarningSink(), store=storage)
    gated.before_next_cas(lambda: competitor.takeover("raced"), match=touches("raced"))
    replaced = _expiry(storage, "free")

    outcomes = reg.takeover_many(["raced", "free"])

    assert outcomes == [
        TakeoverResult(TakeoverStatus.LOST_RACE, "raced", held_by="engine-c"),
        TakeoverResult(TakeoverStatus.ACQUIRED, "free", epoch=2, expires_at=replaced),
    ]
    assert competitor.current_epoch("raced") == 2
    assert reg.list_held_workflow_ids() == ["free"]
    assert _holder(storage, "raced") == HolderRecord("engine-c", 2, clock() + TTL_MS, clock())
    # The holders of lost races are read again in one more read.
    assert gated.reads[-1] == [keys.workflow_owner_holder("raced")]
    assert gated.calls["get"] == 0


def test_a_chunk_whose_commit_is_refused_reports_every_takeover_lost(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "a", "b")
    before = {w: storage.get(keys.workflow_owner_holder(w)) for w in "ab"}
    gated.force_next_cas(False)
    outcomes = reg.takeover_many(["a", "b"])
    assert outcomes == [
        TakeoverResult(TakeoverStatus.LOST_RACE, w, held_by="engine-b") for w in "ab"
    ]
    assert reg.list_held_workflow_ids() == []
    assert {w: storage.get(keys.workflow_owner_holder(w)) for w in "ab"} == before


def test_a_failed_reread_of_lost_holders_keeps_the_takeovers_that_committed(
    make: Factory,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "raced", "free")
    competitor = make("engine-c", WarningSink(), store=storage)
    error = StorageError("re-read failed")

    def compete() -> None:
        competitor.takeover("raced")
        gated.fail_next_read_of(keys.workflow_owner_holder("raced"), error)

    gated.before_next_cas(compete, match=touches("raced"))
    replaced = _expiry(storage, "free")
    outcomes = reg.takeover_many(["raced", "free"])
    assert outcomes[0] is error
    assert outcomes[1] == TakeoverResult(
        TakeoverStatus.ACQUIRED, "free", epoch=2, expires_at=replaced
    )
    assert reg.list_held_workflow_ids() == ["free"]
    assert _holder(storage, "free") == HolderRecord("engine-a", 2, clock() + TTL_MS, clock())


# -- repeats, chunks and failures -----------------------------------------------------------


def test_a_repeated_id_is_attempted_once_and_shares_its_result_object(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "a", "b")
    outcomes = reg.takeover_many(["a", "b", "a", "a"], chunk_size=1)
    assert outcomes[0] is outcomes[2] is outcomes[3]
    assert _statuses(outcomes) == ["acquired"] * 4
    assert (reg.current_epoch("a"), reg.current_epoch("b")) == (2, 2)
    assert storage.get(keys.workflow_owner_epoch("a")) == minted(2)
    assert gated.batch_sizes == [1, 1]
    assert len(gated.reads) == 2


def test_a_chunk_whose_commit_raises_fails_only_its_own_ids(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    ids = [f"wf-{n}" for n in range(5)]
    _expired(rival, clock, *ids)
    error = StorageError("chunk two failed")
    gated.raise_on_next_cas(error, match=touches("wf-2"))

    outcomes = reg.takeover_many(ids, chunk_size=2)

    assert outcomes[2] is error
    assert outcomes[3] is error
    assert _statuses(outcomes) == ["acquired", "acquired", None, None, "acquired"]
    assert gated.batch_sizes == [2, 2, 1]
    assert len(gated.reads) == 3
    assert sorted(reg.list_held_workflow_ids()) == ["wf-0", "wf-1", "wf-4"]
    for wid in ("wf-2", "wf-3"):
        assert (_holder(storage, wid) or HolderRecord("?", 0, 0, 0)).engine_id == "engine-b"
    assert reg.takeover("wf-2").status == "acquired"


def test_a_failing_chunk_keeps_the_outcomes_it_had_already_decided(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    clock: ManualClock,
) -> None:
    _expired(rival, clock, "expired")
    rival.acquire("live")
    error = StorageError("commit failed")
    gated.raise_on_next_cas(error)
    outcomes = reg.takeover_many(["expired", "live", "absent"])
    assert outcomes[0] is error
    assert _statuses(outcomes) == [None, "not-expired", "no-claim"]
    assert reg.list_held_workflow_ids() == []


def test_a_chunk_whose_read_raises_fails_its_ids_and_commits_nothing_for_them(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadCountingStorage,
    clock: ManualClock,
) -> None:
    ids = ["a", "b", "c"]
    _expired(rival, clock, *ids)
    error = StorageError("read failed")
    gated.fail_next_read_of(keys.workflow_owner_holder("a"), error)
    replaced = _expiry(gated.inner, "c")
    outcomes = reg.takeover_many(ids, chunk_size=2)
    assert outcomes[:2] == [error, error]
    assert outcomes[2] == TakeoverResult(TakeoverStatus.ACQUIRED, "c", epoch=2, expires_at=replaced)
    assert gated.batch_sizes == [1]
    assert reg.list_held_workflow_ids() == ["c"]


def test_a_store_without_compare_and_swap_fails_the_takeovers_it_would_commit(
    storage: Storage, rival: ClaimRegistry, clock: ManualClock
) -> None:
    _expired(rival, clock, "expired")
    reg = new_registry(GatedStorage(storage, conditional_batch=False), clock)
    outcomes = reg.takeover_many(["expired", "absent"])
    assert isinstance(outcomes[0], StorageCapabilityError)
    assert _statuses(outcomes) == [None, "no-claim"]
    assert _holder(storage, "expired") == HolderRecord("engine-b", 1, START_MS + TTL_MS, START_MS)


def test_a_commit_answering_with_the_wrong_length_is_a_storage_error(
    storage: Storage, rival: ClaimRegistry, clock: ManualClock
) -> None:
    _expired(rival, clock, "a", "b")
    reg = new_registry(BatchesOnly(storage, drop_result=True), clock)
    outcomes = reg.takeover_many(["a", "b"])
    assert all(isinstance(o, StorageError) for o in outcomes)
    assert "2 batches" in str(outcomes[0])
    assert reg.list_held_workflow_ids() == []


def test_many_ids_are_taken_over_one_transaction_per_chunk(
    reg: ClaimRegistry, gated: ReadCountingStorage, storage: Storage, clock: ManualClock
) -> None:
    ids = [f"wf-{n:04d}" for n in range(DEFAULT_TAKEOVER_CHUNK_SIZE + 1)]
    rows = [(keys.workflow_owner_holder(w), GARBAGE) for w in ids]
    rows += [(keys.workflow_owner_epoch(w), encode_epoch(1)) for w in ids]
    for key, value in rows:
        storage.put(key, value)
    outcomes = reg.takeover_many(ids)
    assert _statuses(outcomes) == ["acquired"] * len(ids)
    assert gated.batch_sizes == [DEFAULT_TAKEOVER_CHUNK_SIZE, 1]
    assert [len(r) for r in gated.reads] == [2 * DEFAULT_TAKEOVER_CHUNK_SIZE, 2]
    assert reg.current_epoch(ids[-1]) == 2


# -- arguments ------------------------------------------------------------------------------


def test_takeover_many_of_nothing_touches_no_storage(
    reg: ClaimRegistry, gated: ReadCountingStorage
) -> None:
    assert reg.takeover_many([]) == []
    assert reg.takeover_many(iter(())) == []
    assert gated.total_calls == 0


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5, True, "2", None])
def test_takeover_many_rejects_a_bad_chunk_size(
    reg: ClaimRegistry, gated: ReadCountingStorage, chunk_size: object
) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        reg.takeover_many(["a"], chunk_size=chunk_size)  # type: ignore[arg-type]
    assert gated.total_calls == 0


@pytest.mark.parametrize("ids", ["wf-1", b"wf-1", bytearray(b"wf-1")])
def test_takeover_many_rejects_a_single_string_instead_of_ids(
    reg: ClaimRegistry, gated: ReadCountingStorage, ids: object
) -> None:
    with pytest.raises(TypeError, match="iterable of workflow ids"):
        reg.takeover_many(ids)  # type: ignore[arg-type]
    assert gated.total_calls == 0


@pytest.mark.parametrize(("bad", "error"), [("", ValueError), (7, TypeError)])
def test_takeover_many_rejects_an_invalid_id_before_any_io(
    reg: ClaimRegistry, gated: ReadCountingStorage, bad: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        reg.takeover_many(["ok", bad])  # type: ignore[list-item]
    assert gated.total_calls == 0


# -- property: takeover_many == sequential takeover -----------------------------------------

KINDS = ["absent", "expired", "live", "garbage", "no-epoch", "rotated", "own", "deposed"]


class _World:
    """One SQLite store, engine A (under test) and engine B, set up from a list of id kinds."""

    def __init__(self, path: Path) -> None:
        self.store = SqliteStorage(path)
        self.clock = ManualClock(START_MS)
        self.sink = WarningSink()
        self.ours = new_registry(self.store, self.clock, "engine-a", self.sink)
        self.theirs = new_registry(self.store, self.clock, "engine-b", WarningSink())

    def build(self, kinds: dict[str, str], advance: int) -> None:
        def of(kind: str) -> list[str]:
            return [w for w, k in kinds.items() if k == kind]

        for wid in of("expired"):
            self.theirs.acquire(wid)
        for wid in of("deposed"):
            self.ours.acquire(wid)
        self.clock.advance(PAST_GRACE_MS)
        for wid in of("deposed"):
            assert self.theirs.takeover(wid).status == "acquired"
            assert self.ours.renew(wid).status == "lost"
        for wid in of("live"):
            self.theirs.acquire(wid)
        for wid in of("own"):
            self.ours.acquire(wid)
        for wid in of("garbage"):
            self.store.put(keys.workflow_owner_holder(wid), GARBAGE)
            self.store.put(keys.workflow_owner_epoch(wid), encode_epoch(7))
        for wid in of("no-epoch"):
            holder = encode_holder(HolderRecord("engine-b", 3, 0, 0))
            self.store.put(keys.workflow_owner_holder(wid), holder)
        for wid in of("rotated"):
            self.theirs.acquire(wid)
            fragment = build_external_rotation_transition(
                workflow_id=wid, observed_epoch_bytes=self.store.get(keys.workflow_owner_epoch(wid))
            )
            assert self.store.conditional_batch(fragment.conditions, fragment.operations)
        self.clock.advance(advance)

    def local_state(self, ids: Sequence[str]) -> list[tuple[str, int | None, object]]:
        return [
            (w, self.ours.current_epoch(w), token_shape(self.ours.current_epoch_bytes(w)))
            for w in ids
        ]


WIDS = ["a", "b", "c", "d", "e", "f"]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.fixed_dictionaries({w: st.sampled_from(KINDS) for w in WIDS}),
    advance=st.sampled_from([0, RENEW_MS - 1, RENEW_MS, TTL_MS + 2 * RENEW_MS + 1])
    | st.integers(0, TTL_MS + 3 * RENEW_MS),
    ids=st.permutations(WIDS).flatmap(lambda p: st.integers(1, len(p)).map(lambda n: p[:n])),
    chunk_size=st.integers(1, 4),
)
def test_takeover_many_matches_sequential_takeover_on_an_identical_store(
    kinds: dict[str, str], advance: int, ids: list[str], chunk_size: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        batched, sequential = _World(Path(tmp) / "one.db"), _World(Path(tmp) / "two.db")
        try:
            for world in (batched, sequential):
                world.build(kinds, advance)
            assert epoch_numbers(batched.store.scan("")) == epoch_numbers(sequential.store.scan(""))

            many = batched.ours.takeover_many(ids, chunk_size=chunk_size)
            one_by_one = [sequential.ours.takeover(wid) for wid in ids]

            assert many == one_by_one
            assert epoch_numbers(batched.store.scan("")) == epoch_numbers(sequential.store.scan(""))
            assert batched.local_state(WIDS) == sequential.local_state(WIDS)
            assert batched.ours.list_held_workflow_ids() == sequential.ours.list_held_workflow_ids()
            # Renewing and releasing prove the tracked holder bytes match the stored ones.
            for world in (batched, sequential):
                world.clock.advance(1)
            renewed = [batched.ours.renew(w) for w in WIDS]
            assert renewed == [sequential.ours.renew(w) for w in WIDS]
            assert all(r.status != "lost" for r in renewed)
            released = [batched.ours.release(w) for w in WIDS]
            assert released == [sequential.ours.release(w) for w in WIDS]
            assert epoch_numbers(batched.store.scan("")) == epoch_numbers(sequential.store.scan(""))
        finally:
            batched.store.close()
            sequential.store.close()
