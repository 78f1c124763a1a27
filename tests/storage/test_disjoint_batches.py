"""``conditional_batches`` over batches on pairwise disjoint keys, on every backend.

PostgreSQL judges such a list (two or more batches, each with a condition, none requiring a key
absent) against one row-locking SELECT and writes the holding batches with one upsert and one
delete; the outcome must be that of committing the batches one after another.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from weft_sync.errors import ClosedError
from weft_sync.storage import Condition, Delete, Operation, Put, Storage
from weft_sync.storage.base import Batch, validate_batch
from weft_sync.storage.postgres.sql import Plan, disjoint, renewal_keys
from weft_sync.storage.postgres.store import PostgresStorage

OpenStore = Callable[[], Storage]
_WAIT_S = 30.0


def _holder(claim: int) -> str:
    return f"holder/{claim:02d}"


def _epoch(claim: int) -> str:
    return f"epoch/{claim:02d}"


def _takeover(claim: int, old: tuple[bytes, bytes], new: tuple[bytes, bytes]) -> Batch:
    """Replace the claim's ``(holder, epoch)`` with ``new`` if it still holds ``old``."""
    return (
        [Condition(_holder(claim), old[0]), Condition(_epoch(claim), old[1])],
        [Put(_holder(claim), new[0]), Put(_epoch(claim), new[1])],
    )


def _takes_the_disjoint_path(batches: Sequence[Batch]) -> bool:
    """Whether PostgresStorage runs ``batches`` through its disjoint-keys path."""
    checked = [validate_batch(conditions, operations) for conditions, operations in batches]
    if renewal_keys(checked) is not None:
        return False
    return disjoint([Plan.build(conditions, operations) for conditions, operations in checked])


def _claims(storage: Storage, count: int, holder: bytes = b"A", epoch: bytes = b"1") -> None:
    storage.batch(
        [Put(k, v) for c in range(count) for k, v in ((_holder(c), holder), (_epoch(c), epoch))]
    )


def test_disjoint_batches_report_each_outcome_and_apply_only_the_holding_ones(
    storage: Storage,
) -> None:
    _claims(storage, 5)
    storage.batch([Put("gone", b"g"), Put("lone", b"x")])
    batches: list[Batch] = [
        _takeover(0, (b"A", b"1"), (b"B", b"2")),
        _takeover(1, (b"stale", b"1"), (b"B", b"2")),
        _takeover(2, (b"A", b"stale"), (b"B", b"2")),
        (
            [Condition(_holder(3), b"A"), Condition(_epoch(3), b"1")],
            [Delete(_holder(3)), Put(_epoch(3), b"2")],
        ),
        ([Condition("gone", b"g")], [Delete("gone"), Put("new", b"n")]),
        ([Condition("lone", b"wrong")], [Delete("lone")]),
        ([Condition(_holder(4), b"A")], [Put(_holder(4), b"A2")]),
    ]
    assert _takes_the_disjoint_path(batches)
    assert storage.conditional_batches(batches) == [True, False, False, True, True, False, True]
    assert storage.scan() == [
        (_epoch(0), b"2"),
        (_epoch(1), b"1"),
        (_epoch(2), b"1"),
        (_epoch(3), b"2"),
        (_epoch(4), b"1"),
        (_holder(0), b"B"),
        (_holder(1), b"A"),
        (_holder(2), b"A"),
        (_holder(4), b"A2"),
        ("lone", b"x"),
        ("new", b"n"),
    ]


def test_a_condition_on_a_missing_key_fails_its_batch_and_writes_nothing(
    storage: Storage,
) -> None:
    storage.batch([Put("present", b"p"), Put("empty", b""), Put("spare", b"s")])
    batches: list[Batch] = [
        ([Condition("missing", b"x")], [Put("missing", b"y"), Put("side", b"s")]),
        ([Condition("present", b"p")], [Put("present", b"q")]),
        ([Condition("absent", b"")], [Put("absent", b"w"), Delete("spare")]),
        ([Condition("empty", b""), Condition("other", b"o")], [Put("empty", b"e")]),
    ]
    assert _takes_the_disjoint_path(batches)
    assert storage.conditional_batches(batches) == [False, True, False, False]
    assert storage.scan() == [("empty", b""), ("present", b"q"), ("spare", b"s")]


def test_batches_with_conditions_only_report_without_writing(storage: Storage) -> None:
    storage.batch([Put("a", b"1"), Put("b", b"")])
    batches: list[Batch] = [
        ([Condition("a", b"1")], []),
        ([Condition("b", b"")], []),
        ([Condition("c", b"1")], []),
        ([Condition("d", b"1")], [Put("d", b"written")]),
    ]
    assert _takes_the_disjoint_path(batches)
    assert storage.conditional_batches(batches) == [True, True, False, False]
    assert storage.scan() == [("a", b"1"), ("b", b"")]


def test_the_last_operation_on_a_key_wins_within_each_disjoint_batch(storage: Storage) -> None:
    storage.batch([Put("a", b"1"), Put("b", b"1"), Put("x", b"old"), Put("y", b"old")])
    batches: list[Batch] = [
        ([Condition("a", b"1")], [Put("x", b"first"), Delete("x"), Put("a", b"2")]),
        ([Condition("b", b"1")], [Delete("y"), Put("y", b"last"), Put("y", b"final")]),
    ]
    assert _takes_the_disjoint_path(batches)
    assert storage.conditional_batches(batches) == [True, True]
    assert storage.scan() == [("a", b"2"), ("b", b"1"), ("y", b"final")]


def test_a_bad_batch_anywhere_in_the_list_raises_before_anything_is_written(
    storage: Storage,
) -> None:
    _claims(storage, 2)
    batches: list[Batch] = [
        _takeover(0, (b"A", b"1"), (b"B", b"2")),
        ([Condition(_holder(1), b"A")], [Put(_holder(1), "not bytes")]),  # type: ignore[arg-type]
    ]
    with pytest.raises(TypeError, match="'not bytes'"):
        storage.conditional_batches(batches)
    assert storage.get(_holder(0)) == b"A"
    assert storage.get(_epoch(0)) == b"1"


def test_disjoint_batches_after_close_raise_closed_error(open_store: OpenStore) -> None:
    store = open_store()
    _claims(store, 2)
    store.close()
    batches = [_takeover(c, (b"A", b"1"), (b"B", b"2")) for c in range(2)]
    with pytest.raises(ClosedError):
        store.conditional_batches(batches)
    assert open_store().get(_holder(0)) == b"A"


def test_the_shapes_that_leave_the_disjoint_path_are_recognised() -> None:
    takeover = _takeover(0, (b"A", b"1"), (b"B", b"2"))
    assert not _takes_the_disjoint_path([takeover])
    assert not _takes_the_disjoint_path([takeover, _takeover(0, (b"B", b"2"), (b"C", b"3"))])
    assert not _takes_the_disjoint_path([takeover, ([Condition("k", None)], [Put("k", b"1")])])
    assert not _takes_the_disjoint_path([takeover, ([], [Put("k", b"1")])])
    assert not _takes_the_disjoint_path([takeover, ([Condition("k", b"1")], [Put(_epoch(0), b"")])])
    assert _takes_the_disjoint_path([takeover, ([Condition("k", b"1")], [Put("j", b"")])])


# -- against one conditional_batch per batch --------------------------------------------------

_counter = itertools.count()
_KEYS = tuple(f"k{n}" for n in range(6))
_VALUES = (b"", b"1", b"2")


def _operations(draw: st.DrawFn, pool: Sequence[str]) -> list[Operation]:
    operation = st.one_of(
        st.builds(Put, st.sampled_from(pool), st.sampled_from(_VALUES)),
        st.builds(Delete, st.sampled_from(pool)),
    )
    return draw(st.lists(operation, max_size=3))


def _chain(draw: st.DrawFn, initial: dict[str, bytes]) -> list[Batch]:
    """Batches on one key, each expecting (mostly) what the batch before it writes."""
    key = draw(st.sampled_from(_KEYS))
    values = draw(st.lists(st.sampled_from(_VALUES), min_size=5, max_size=5))
    initial[key] = values[0]
    batches: list[Batch] = []
    for index in range(draw(st.integers(2, 4))):
        expected = draw(st.sampled_from([values[index]] * 3 + [b"other"]))
        extra = _operations(draw, _KEYS)
        batches.append(([Condition(key, expected)], [Put(key, values[index + 1]), *extra]))
    return batches


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[dict[str, bytes], list[Batch]]:
    """An initial state and a list of batches: disjoint, chained on one key, or free-form.

    Disjoint lists give every batch a key of its own and at least one condition, so that most of
    them (those with no condition expecting ``None``) take PostgreSQL's disjoint-keys path. In a
    chain each batch mostly holds only after the one before it, so judging every batch against
    the state before the first would give other results.
    """
    initial = draw(st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_VALUES)))
    shape = draw(st.sampled_from(["disjoint", "disjoint", "chain", "free"]))
    if shape == "chain":
        return initial, _chain(draw, initial)
    allow_absent = draw(st.sampled_from([False, False, True]))
    count = draw(st.integers(2, 4) if shape == "disjoint" else st.integers(0, 4))
    keys = draw(st.permutations(_KEYS))
    extra = draw(st.lists(st.integers(-1, count - 1), min_size=len(_KEYS), max_size=len(_KEYS)))
    owners = [*range(count), *extra[count:]]
    batches: list[Batch] = []
    for index in range(count):
        if shape == "disjoint":
            pool = [k for k, owner in zip(keys, owners, strict=True) if owner == index]
        else:
            pool = draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3))
        conditions = []
        least = 1 if shape == "disjoint" else 0
        for key in draw(st.lists(st.sampled_from(pool), min_size=least, max_size=2)):
            current = initial.get(key)
            choices = [current, *_VALUES, None] if allow_absent else [*_VALUES]
            if current is not None:
                choices += [current, current]
            conditions.append(Condition(key, draw(st.sampled_from(choices))))
        batches.append((conditions, _operations(draw, pool)))
    return initial, batches


def _in(ns: str, batches: list[Batch]) -> list[Batch]:
    moved: list[Batch] = []
    for conditions, operations in batches:
        ops: list[Operation] = [
            Put(ns + op.key, op.value) if isinstance(op, Put) else Delete(ns + op.key)
            for op in operations
        ]
        moved.append(([Condition(ns + c.key, c.expected) for c in conditions], ops))
    return moved


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenario=_scenarios())
def test_conditional_batches_equal_one_conditional_batch_per_batch(
    storage: Storage, scenario: tuple[dict[str, bytes], list[Batch]]
) -> None:
    initial, batches = scenario
    if isinstance(storage, PostgresStorage):
        event("disjoint path" if _takes_the_disjoint_path(batches) else "other path")
    run = next(_counter)
    together_ns, one_by_one_ns = f"t{run}/", f"o{run}/"
    for ns in (together_ns, one_by_one_ns):
        storage.batch([Put(ns + k, v) for k, v in initial.items()])
    together = storage.conditional_batches(_in(together_ns, batches))
    one_by_one = [
        storage.conditional_batch(conditions, operations)
        for conditions, operations in _in(one_by_one_ns, batches)
    ]
    assert together == one_by_one
    assert [(k[len(together_ns) :], v) for k, v in storage.scan(together_ns)] == [
        (k[len(one_by_one_ns) :], v) for k, v in storage.scan(one_by_one_ns)
    ]


# -- PostgreSQL: concurrent takeovers of the same claims --------------------------------------

CLAIMS = 20
ROUNDS = 20


def _race_round(
    stores: tuple[Storage, Storage], old: list[tuple[bytes, bytes]], round_no: int, rival: str
) -> tuple[list[bool], list[bool]]:
    """Both stores try to take over every claim at once; results are in claim order."""
    start = threading.Barrier(2, timeout=_WAIT_S)
    results: dict[int, list[bool]] = {}
    errors: list[BaseException] = []

    def new(racer: int) -> tuple[bytes, bytes]:
        return (b"racer%d-round%d" % (racer, round_no), b"%d-%d" % (round_no + 1, racer))

    def first() -> None:
        batches = [_takeover(c, old[c], new(0)) for c in range(CLAIMS)]
        start.wait()
        results[0] = stores[0].conditional_batches(batches)

    def second() -> None:
        claims = list(reversed(range(CLAIMS)))
        batches = [_takeover(c, old[c], new(1)) for c in claims]
        start.wait()
        if rival == "disjoint":
            won = stores[1].conditional_batches(batches)
        else:
            won = [stores[1].conditional_batch(*batch) for batch in batches]
        results[1] = won[::-1]

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                errors.append(exc)
                start.abort()

        return run

    threads = [
        threading.Thread(target=guarded(body), name=f"takeover-racer-{n}", daemon=True)
        for n, body in enumerate((first, second))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a racer never finished"
    for exc in errors:
        raise exc
    return results[0], results[1]


@pytest.mark.postgres_only
@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("rival", ["disjoint", "one-claim-at-a-time"])
def test_concurrent_takeovers_of_the_same_claims_have_exactly_one_winner_each(
    open_store: OpenStore, rival: str
) -> None:
    checker = open_store()
    assert isinstance(checker, PostgresStorage)
    stores = (open_store(), open_store())
    _claims(checker, CLAIMS, b"origin", b"0")
    old = [(b"origin", b"0")] * CLAIMS
    assert _takes_the_disjoint_path([_takeover(c, old[c], old[c]) for c in range(CLAIMS)])
    wins = [0, 0]
    for round_no in range(ROUNDS):
        first, second = _race_round(stores, old, round_no, rival)
        for claim in range(CLAIMS):
            assert first[claim] != second[claim], f"round {round_no} claim {claim}"
            winner = 0 if first[claim] else 1
            wins[winner] += 1
            expected = (b"racer%d-round%d" % (winner, round_no), b"%d-%d" % (round_no + 1, winner))
            assert (checker.get(_holder(claim)), checker.get(_epoch(claim))) == expected
            old[claim] = expected
    assert sum(wins) == CLAIMS * ROUNDS
    assert len(checker.scan()) == 2 * CLAIMS
