"""The Storage contract, run against every real backend through the ``storage`` fixtures."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import pytest

from weft_sync.errors import ClosedError
from weft_sync.storage import (
    Condition,
    Delete,
    Put,
    Storage,
    StorageCapabilities,
    open_storage,
)
from weft_sync.storage.base import tightest_bounds

OpenStore = Callable[[], Storage]

# Ascending UTF-8 byte order. UTF-16 code-unit order would put the emoji (a surrogate pair)
# before U+E000; byte order puts it after.
ORDERED_KEYS = [
    "a",
    "a/1",
    "a/2",
    "ab",
    "b",
    "z",
    "\u00e9",
    "\u00e9x",
    "\u00ea",
    "\ue000",
    "\U0001f600",
    "\U0010ffff",
    "\U0010ffffa",
]


def _fill(storage: Storage, keys: list[str]) -> None:
    storage.batch([Put(key, key.encode("utf-8")) for key in reversed(keys)])


def _keys(rows: list[tuple[str, bytes]]) -> list[str]:
    return [key for key, _ in rows]


# -- get / put / delete ---------------------------------------------------------------------


def test_storage_satisfies_the_protocol_and_declares_cas(storage: Storage) -> None:
    assert isinstance(storage, Storage)
    caps = storage.capabilities
    assert isinstance(caps, StorageCapabilities)
    assert caps.conditional_batch is True


def test_get_of_an_absent_key_returns_none(storage: Storage) -> None:
    assert storage.get("missing") is None


@pytest.mark.parametrize("value", [b"", b"v", b"\x00\xff\x00binary", bytes(range(256)) * 40])
def test_put_then_get_returns_the_exact_bytes(storage: Storage, value: bytes) -> None:
    storage.put("k", value)
    got = storage.get("k")
    assert type(got) is bytes
    assert got == value


def test_put_accepts_bytes_like_values_and_stores_bytes(storage: Storage) -> None:
    storage.put("ba", bytearray(b"xy"))  # type: ignore[arg-type]
    storage.put("mv", memoryview(b"zw"))  # type: ignore[arg-type]
    assert storage.get("ba") == b"xy"
    assert storage.get("mv") == b"zw"
    assert type(storage.get("mv")) is bytes


def test_put_overwrites_the_previous_value(storage: Storage) -> None:
    storage.put("k", b"long old value")
    storage.put("k", b"new")
    assert storage.get("k") == b"new"


def test_delete_removes_the_key(storage: Storage) -> None:
    storage.put("k", b"v")
    storage.put("other", b"o")
    storage.delete("k")
    assert storage.get("k") is None
    assert storage.get("other") == b"o"


def test_delete_of_an_absent_key_is_a_no_op(storage: Storage) -> None:
    storage.delete("missing")
    assert storage.get("missing") is None
    assert storage.scan() == []


# -- batch ----------------------------------------------------------------------------------


def test_batch_applies_operations_in_order_so_the_last_one_on_a_key_wins(
    storage: Storage,
) -> None:
    storage.put("d", b"old")
    storage.batch(
        [
            Put("a", b"1"),
            Put("a", b"2"),
            Put("b", b"1"),
            Delete("b"),
            Delete("c"),
            Put("c", b"3"),
            Delete("d"),
        ]
    )
    assert storage.scan() == [("a", b"2"), ("c", b"3")]


def test_empty_batch_is_a_no_op(storage: Storage) -> None:
    storage.put("k", b"v")
    storage.batch([])
    assert storage.scan() == [("k", b"v")]


# -- conditional_batch ----------------------------------------------------------------------


def test_condition_expecting_absent_creates_a_key_only_once(storage: Storage) -> None:
    assert storage.conditional_batch([Condition("k", None)], [Put("k", b"first")]) is True
    assert storage.conditional_batch([Condition("k", None)], [Put("k", b"second")]) is False
    assert storage.get("k") == b"first"


def test_empty_condition_list_always_commits(storage: Storage) -> None:
    assert storage.conditional_batch([], [Put("a", b"1"), Put("b", b"2")]) is True
    assert storage.conditional_batch([], []) is True
    assert storage.scan() == [("a", b"1"), ("b", b"2")]


def test_condition_and_operation_may_name_the_same_key(storage: Storage) -> None:
    storage.put("counter", b"1")
    assert storage.conditional_batch([Condition("counter", b"1")], [Put("counter", b"2")])
    assert not storage.conditional_batch([Condition("counter", b"1")], [Put("counter", b"3")])
    assert storage.conditional_batch([Condition("counter", b"2")], [Delete("counter")])
    assert storage.get("counter") is None


def test_failed_condition_among_several_writes_nothing(storage: Storage) -> None:
    storage.batch([Put("a", b"A"), Put("b", b"B"), Put("d", b"D")])
    committed = storage.conditional_batch(
        [Condition("a", b"A"), Condition("b", b"not B"), Condition("c", None)],
        [Put("a", b"A2"), Put("c", b"C"), Delete("d")],
    )
    assert committed is False
    assert storage.scan() == [("a", b"A"), ("b", b"B"), ("d", b"D")]


@pytest.mark.parametrize("wrong", ["k", "e", "missing"])
def test_a_failed_condition_on_present_keys_writes_nothing(storage: Storage, wrong: str) -> None:
    # Every condition expects bytes (none requires a key absent): a release's shape.
    storage.batch([Put("k", b"K"), Put("e", b"E"), Put("gone", b"G")])
    conditions = [Condition("k", b"K"), Condition("e", b"E")]
    conditions = [c if c.key != wrong else Condition(wrong, b"other") for c in conditions]
    if wrong == "missing":
        conditions.append(Condition("missing", b"M"))
    writes = [Put("k", b"K2"), Put("new", b"N"), Delete("gone")]
    assert storage.conditional_batch(conditions, writes) is False
    assert storage.scan() == [("e", b"E"), ("gone", b"G"), ("k", b"K")]
    right = [Condition("k", b"K"), Condition("e", b"E")]
    assert storage.conditional_batch(right, writes) is True
    assert storage.scan() == [("e", b"E"), ("k", b"K2"), ("new", b"N")]


@pytest.mark.parametrize("count", [1, 2, 4, 5, 9])
def test_conditions_on_any_number_of_keys_are_each_judged(storage: Storage, count: int) -> None:
    # A few keys and many are read differently on SQLite (a lookup each, or one query): both
    # judge every condition, on present and absent keys, a key named twice included.
    present = [f"k{i}" for i in range(count)]
    storage.batch([Put(key, key.encode()) for key in present])
    conditions = [Condition(key, key.encode()) for key in present]
    conditions += [Condition("absent", None), Condition(present[0], present[0].encode())]
    assert storage.conditional_batch(conditions, [Put("done", b"1")]) is True
    assert storage.get("done") == b"1"
    for wrong in range(count):
        judged = list(conditions)
        judged[wrong] = Condition(present[wrong], b"other")
        assert storage.conditional_batch(judged, [Put("done", b"2")]) is False
    assert storage.conditional_batch([*conditions, Condition("done", None)], []) is False
    assert storage.get("done") == b"1"


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (b"abc", b"ab"),
        (b"abc", b"abcd"),
        (b"abc", b"ABC"),
        (b"abc", None),
        (b"", None),
        (None, b""),
    ],
)
def test_condition_compares_the_whole_value_byte_for_byte(
    storage: Storage, stored: bytes | None, expected: bytes | None
) -> None:
    if stored is not None:
        storage.put("k", stored)
    assert storage.conditional_batch([Condition("k", expected)], [Put("k", b"changed")]) is False
    assert storage.get("k") == stored
    assert storage.conditional_batch([Condition("k", stored)], [Put("k", b"changed")]) is True
    assert storage.get("k") == b"changed"


# -- scan -----------------------------------------------------------------------------------


def test_scan_returns_every_key_in_utf8_byte_order(storage: Storage) -> None:
    assert sorted(ORDERED_KEYS, key=lambda k: k.encode("utf-8")) == ORDERED_KEYS
    _fill(storage, ORDERED_KEYS)
    rows = storage.scan()
    assert _keys(rows) == ORDERED_KEYS
    assert all(value == key.encode("utf-8") for key, value in rows)
    assert _keys(storage.scan(reverse=True)) == ORDERED_KEYS[::-1]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("a", ["a", "a/1", "a/2", "ab"]),
        ("a/", ["a/1", "a/2"]),
        ("a/1", ["a/1"]),
        ("zz", []),
        ("\u00e9", ["\u00e9", "\u00e9x"]),
        ("\U0010ffff", ["\U0010ffff", "\U0010ffffa"]),
        ("", ORDERED_KEYS),
    ],
)
def test_scan_prefix_selects_exactly_the_keys_starting_with_it(
    storage: Storage, prefix: str, expected: list[str]
) -> None:
    _fill(storage, ORDERED_KEYS)
    assert _keys(storage.scan(prefix)) == expected
    assert _keys(storage.scan(prefix, reverse=True)) == expected[::-1]


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ({"gt": "a/1"}, ["a/2", "ab"]),
        ({"gte": "a/1"}, ["a/1", "a/2", "ab"]),
        ({"lt": "a/2"}, ["a", "a/1"]),
        ({"lte": "a/2"}, ["a", "a/1", "a/2"]),
        ({"gt": "a", "lt": "ab"}, ["a/1", "a/2"]),
        ({"gte": "a/", "lte": "a/9"}, ["a/1", "a/2"]),
        ({"gt": "ab"}, []),
        ({"gt": "b"}, []),
    ],
)
def test_scan_bounds_narrow_the_prefix_range(
    storage: Storage, bounds: dict[str, str], expected: list[str]
) -> None:
    _fill(storage, ORDERED_KEYS)
    assert _keys(storage.scan("a", **bounds)) == expected  # type: ignore[arg-type]


def test_scan_bounds_follow_byte_order_for_non_ascii_keys(storage: Storage) -> None:
    _fill(storage, ORDERED_KEYS)
    assert _keys(storage.scan(gt="\u00ea", lt="\U0010ffff")) == ["\ue000", "\U0001f600"]
    assert _keys(storage.scan(gte="\U0001f600")) == ["\U0001f600", "\U0010ffff", "\U0010ffffa"]


def test_scan_limit_caps_rows_from_the_requested_end(storage: Storage) -> None:
    _fill(storage, ORDERED_KEYS)
    assert _keys(storage.scan("a", limit=2)) == ["a", "a/1"]
    assert _keys(storage.scan("a", limit=2, reverse=True)) == ["ab", "a/2"]
    assert _keys(storage.scan("a", gt="a", limit=1, reverse=True)) == ["ab"]
    assert storage.scan("a", limit=0) == []
    assert _keys(storage.scan("a", limit=100)) == ["a", "a/1", "a/2", "ab"]


@pytest.mark.parametrize("limit", [-1, 1.5, "3", True])
def test_scan_rejects_a_bad_limit_naming_it(storage: Storage, limit: object) -> None:
    with pytest.raises((TypeError, ValueError), match=repr(limit).replace(".", r"\.")):
        storage.scan("a", limit=limit)  # type: ignore[arg-type]


def test_scan_result_is_a_snapshot_callers_may_write_while_iterating(storage: Storage) -> None:
    _fill(storage, ["k1", "k2", "k3"])
    rows = storage.scan("k")
    seen = []
    for key, value in rows:
        seen.append((key, value))
        storage.delete("k3")
        storage.put(key + "+", b"new")
    assert seen == [("k1", b"k1"), ("k2", b"k2"), ("k3", b"k3")]
    assert _keys(storage.scan("k")) == ["k1", "k1+", "k2", "k2+", "k3+"]


# -- conditional_batches --------------------------------------------------------------------


def test_conditional_batches_of_an_empty_list_returns_an_empty_list(storage: Storage) -> None:
    assert storage.conditional_batches([]) == []


def test_conditional_batches_judges_each_batch_independently(storage: Storage) -> None:
    storage.put("x", b"1")
    results = storage.conditional_batches(
        [
            ([Condition("x", b"wrong")], [Put("a", b"A")]),
            ([Condition("x", b"1")], [Put("b", b"B")]),
            ([Condition("y", b"missing")], [Delete("x")]),
            ([], [Put("c", b"C")]),
        ]
    )
    assert results == [False, True, False, True]
    assert storage.scan() == [("b", b"B"), ("c", b"C"), ("x", b"1")]


def test_conditional_batches_judges_each_batch_after_the_earlier_ones(storage: Storage) -> None:
    results = storage.conditional_batches(
        [
            ([Condition("k", None)], [Put("k", b"1")]),
            ([Condition("k", b"1")], [Put("k", b"2")]),
            ([Condition("k", None)], [Put("k", b"lost")]),
            ([Condition("k", b"2")], [Delete("k"), Put("done", b"")]),
            ([Condition("k", None), Condition("done", b"")], [Put("k", b"3")]),
        ]
    )
    assert results == [True, True, False, True, True]
    assert storage.scan() == [("done", b""), ("k", b"3")]


# -- bad input ------------------------------------------------------------------------------


BAD_CALLS: list[tuple[str, Callable[[Storage], object], type[Exception], str]] = [
    ("put str value", lambda s: s.put("k", "text"), TypeError, "'text'"),  # type: ignore[arg-type]
    ("put int value", lambda s: s.put("k", 7), TypeError, "7"),  # type: ignore[arg-type]
    ("put bytes key", lambda s: s.put(b"k", b"v"), TypeError, "b'k'"),  # type: ignore[arg-type]
    ("put lone surrogate", lambda s: s.put("k\ud800", b"v"), ValueError, r"k\\ud800"),
    ("put NUL key", lambda s: s.put("k\x00", b"v"), ValueError, r"k\\x00"),
    ("get int key", lambda s: s.get(5), TypeError, "5"),  # type: ignore[arg-type]
    ("delete None key", lambda s: s.delete(None), TypeError, "None"),  # type: ignore[arg-type]
    ("scan int prefix", lambda s: s.scan(3), TypeError, "3"),  # type: ignore[arg-type]
    ("scan surrogate bound", lambda s: s.scan(gt="\udfff"), ValueError, r"\\udfff"),
    (
        "batch with one bad op",
        lambda s: s.batch([Put("k", b"ok"), Put("k2", "bad")]),  # type: ignore[arg-type]
        TypeError,
        "'bad'",
    ),
    (
        "batch with a non-operation",
        lambda s: s.batch([Put("k", b"ok"), ("k2", b"v")]),  # type: ignore[list-item]
        TypeError,
        "'k2'",
    ),
    (
        "cas with a str expected value",
        lambda s: s.conditional_batch([Condition("k", "x")], [Put("k", b"v")]),  # type: ignore[arg-type]
        TypeError,
        "'x'",
    ),
    (
        "cas with a bad operation key",
        lambda s: s.conditional_batch([], [Put("k", b"v"), Delete(1)]),  # type: ignore[arg-type]
        TypeError,
        "1",
    ),
    (
        "batches with one bad batch",
        lambda s: s.conditional_batches(
            [([], [Put("k", b"ok")]), ([Condition("k\ud800", None)], [])]
        ),
        ValueError,
        r"k\\ud800",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "named"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_naming_the_value_and_writes_nothing(
    storage: Storage, call: Callable[[Storage], object], error: type[Exception], named: str
) -> None:
    storage.put("existing", b"e")
    with pytest.raises(error, match=named):
        call(storage)
    assert storage.scan() == [("existing", b"e")]


# -- lifecycle ------------------------------------------------------------------------------


AFTER_CLOSE: list[tuple[str, Callable[[Storage], object]]] = [
    ("get", lambda s: s.get("k")),
    ("put", lambda s: s.put("k", b"v")),
    ("delete", lambda s: s.delete("k")),
    ("scan", lambda s: s.scan()),
    ("batch", lambda s: s.batch([Put("k", b"v")])),
    ("empty batch", lambda s: s.batch([])),
    ("conditional_batch", lambda s: s.conditional_batch([], [Put("k", b"v")])),
    ("conditional_batches", lambda s: s.conditional_batches([([], [Put("k", b"v")])])),
    ("empty conditional_batches", lambda s: s.conditional_batches([])),
]


@pytest.mark.parametrize("call", [c[1] for c in AFTER_CLOSE], ids=[c[0] for c in AFTER_CLOSE])
def test_any_call_after_close_raises_closed_error(
    open_store: OpenStore, call: Callable[[Storage], object]
) -> None:
    store = open_store()
    store.put("k", b"before")
    store.get("k")
    store.close()
    with pytest.raises(ClosedError):
        call(store)
    assert open_store().get("k") == b"before"


def test_close_is_idempotent(open_store: OpenStore) -> None:
    store = open_store()
    store.put("k", b"v")
    store.close()
    store.close()
    with pytest.raises(ClosedError):
        store.get("k")


def test_storage_is_a_context_manager_that_closes_on_exit(open_store: OpenStore) -> None:
    with open_store() as store:
        store.put("k", b"v")
    with pytest.raises(ClosedError):
        store.get("k")
    assert open_store().get("k") == b"v"


def test_a_second_instance_sees_the_first_instances_commits(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    first.put("k", b"1")
    assert second.get("k") == b"1"
    assert second.conditional_batch([Condition("k", b"1")], [Put("k", b"2")])
    assert first.get("k") == b"2"
    assert not first.conditional_batch([Condition("k", b"1")], [Put("k", b"3")])
    first.delete("k")
    assert second.scan() == []


# -- lost updates ---------------------------------------------------------------------------

_THREADS = 4
_PROCESSES = 2
_INCREMENTS = 25
_COUNTER = "counter"


def _increment(store: Storage, times: int) -> None:
    """Add ``times`` to the counter using only read + compare-and-swap, retrying lost races."""
    for _ in range(times):
        while True:
            current = store.get(_COUNTER)
            nxt = str(int(current or b"0") + 1).encode("ascii")
            if store.conditional_batch([Condition(_COUNTER, current)], [Put(_COUNTER, nxt)]):
                break


def _increment_in_process(url: str, times: int, ready: Any, go: Any) -> None:
    with open_storage(url) as store:
        store.get(_COUNTER)
        ready.release()
        if not go.wait(60):
            raise TimeoutError("the parent never signalled the start")
        _increment(store, times)


def test_concurrent_cas_increments_from_threads_and_processes_lose_no_update(
    storage_url: str, open_store: OpenStore
) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Semaphore(0), ctx.Event()
    procs = [
        ctx.Process(target=_increment_in_process, args=(storage_url, _INCREMENTS, ready, go))
        for _ in range(_PROCESSES)
    ]
    stores = [open_store(), open_store()]
    start = threading.Barrier(_THREADS + 1)
    errors: list[BaseException] = []

    def run(store: Storage) -> None:
        try:
            start.wait(timeout=60)
            _increment(store, _INCREMENTS)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(stores[i % 2],), name=f"increment-{i}")
        for i in range(_THREADS)
    ]
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            assert ready.acquire(timeout=60), "a worker process did not start"
        for thread in threads:
            thread.start()
        go.set()
        start.wait(timeout=60)
    except BaseException:
        start.abort()
        raise
    finally:
        go.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(timeout=60)
        for proc in procs:
            proc.join(timeout=60)
            if proc.pid is not None and proc.exitcode is None:
                proc.kill()
                proc.join()
    for exc in errors:
        raise exc
    assert [proc.exitcode for proc in procs] == [0] * _PROCESSES
    expected = (_THREADS + _PROCESSES) * _INCREMENTS
    assert stores[0].get(_COUNTER) == str(expected).encode("ascii")


def test_every_combination_of_bounds_selects_what_each_bound_selects(storage: Storage) -> None:
    """Both bounds of a side, tighter or looser than the prefix, equal or not (model check)."""
    _fill(storage, ORDERED_KEYS)
    stored = sorted(ORDERED_KEYS)
    combos = [
        (prefix, gt, gte, lt, lte)
        for prefix in ("", "a", "a/")
        for gt in (None, "", "a", "a/1", "a/2")
        for gte in (None, "a", "a/1", "a/2", "b")
        for lt in (None, "a/2", "ab", "\U0010ffff")
        for lte in (None, "a/2", "a/9")
    ]
    for prefix, gt, gte, lt, lte in combos:
        expected = [
            k
            for k in stored
            if k.startswith(prefix)
            and (gt is None or k > gt)
            and (gte is None or k >= gte)
            and (lt is None or k < lt)
            and (lte is None or k <= lte)
        ]
        got = storage.scan(prefix, gt=gt, gte=gte, lt=lt, lte=lte)
        assert _keys(got) == expected, (prefix, gt, gte, lt, lte)
        reverse = storage.scan(prefix, gt=gt, gte=gte, lt=lt, lte=lte, limit=2, reverse=True)
        assert _keys(reverse) == expected[::-1][:2], (prefix, gt, gte, lt, lte)


@pytest.mark.parametrize(
    ("prefix", "comparisons", "expected"),
    [
        ("p:", [("<", "p;")], [(">=", "p:"), ("<", "p;")]),
        ("p:", [("<", "p;"), (">", "p:5")], [(">", "p:5"), ("<", "p;")]),
        ("p:", [(">", "a")], [(">=", "p:")]),  # a cursor below the prefix does not widen it
        ("p:", [(">", "p:")], [(">", "p:")]),  # equal bounds: the strict one
        ("p:", [(">=", "p:5"), (">", "p:5")], [(">", "p:5")]),
        ("", [("<=", "m"), ("<", "m")], [(">=", ""), ("<", "m")]),
        ("", [("<", "m"), ("<=", "k")], [(">=", ""), ("<=", "k")]),
    ],
)
def test_a_scan_is_bounded_by_its_tightest_bound_on_each_side(
    prefix: str, comparisons: list[tuple[str, str]], expected: list[tuple[str, str]]
) -> None:
    assert tightest_bounds(prefix, comparisons) == expected
