"""PostgreSQL-specific behaviour of PostgresStorage: atomicity under real races, the renewal fast
path, key collation, server restarts, fork safety and error translation."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import psycopg
import pytest

from tests.forking import expected_fork_warning
from tests.pgcluster import PostgresCluster
from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import Condition, Delete, Operation, Put, open_storage
from weft_sync.storage.postgres.sql import SCALARS_UP_TO
from weft_sync.storage.postgres.store import PostgresStorage

_WAIT_S = 30.0


def _new_table() -> str:
    return "t_" + uuid.uuid4().hex[:16]


def _with_params(url: str, **params: object) -> str:
    extra = "&".join(f"{k}={v}" for k, v in params.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


@pytest.fixture
def table(postgres_base_url: str) -> Iterator[str]:
    """A fresh table name, dropped after the test."""
    name = _new_table()
    yield name
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


@pytest.fixture
def make_store(postgres_base_url: str, table: str) -> Iterator[Callable[..., PostgresStorage]]:
    """Open PostgresStorage instances on the test's table; all are closed after the test."""
    opened: list[PostgresStorage] = []

    def _make(**kwargs: Any) -> PostgresStorage:
        store = PostgresStorage(postgres_base_url, table=table, **kwargs)
        opened.append(store)
        return store

    yield _make
    for store in opened:
        store.close()


@pytest.fixture
def raw(postgres_base_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit psycopg connection to the same server."""
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        yield conn


# -- a deliberately naive CAS, to show the race harness can fail ---------------------------


class _Cas(Protocol):
    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool: ...

    def close(self) -> None: ...


class NaiveCas:
    """A CAS that locks existing rows with ``SELECT … FOR UPDATE``, compares, then upserts.

    It cannot lock a row that does not exist yet. With ``claim_written`` it inserts the keys it
    expects absent and writes with ``INSERT … ON CONFLICT DO NOTHING`` (as PostgresStorage does)
    but only checks the ones it expects absent and does not write.
    """

    def __init__(self, url: str, table: str, *, claim_written: bool = False) -> None:
        self._conn = psycopg.connect(url, autocommit=True)
        self._table = table
        self._claim_written = claim_written

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        t = self._table
        absent = {c.key for c in conditions if c.expected is None}
        committed = True
        with self._conn.transaction() as tx:
            rows = self._conn.execute(
                f'SELECT key, value FROM "{t}" WHERE key = ANY(%s) ORDER BY key FOR UPDATE',
                [sorted({c.key for c in conditions})],
            ).fetchall()
            found: dict[str, bytes] = dict(rows)
            if any(found.get(c.key) != c.expected for c in conditions):
                return False
            for op in operations:
                assert isinstance(op, Put)
                if self._claim_written and op.key in absent:
                    cur = self._conn.execute(
                        f'INSERT INTO "{t}" VALUES (%s, %s) ON CONFLICT DO NOTHING',
                        [op.key, op.value],
                    )
                    if cur.rowcount != 1:
                        committed = False
                        raise psycopg.Rollback(tx)
                else:
                    self._conn.execute(
                        f'INSERT INTO "{t}" VALUES (%s, %s) '
                        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                        [op.key, op.value],
                    )
        return committed

    def close(self) -> None:
        self._conn.close()


# -- the race harness ------------------------------------------------------------------------


def _me(index: int) -> bytes:
    return f"racer-{index}".encode()


def _attempt(store: Any, move: str, trial: int, index: int) -> bool:
    """One racer's move in one trial; every move has exactly one winner when run serially."""
    me = _me(index)
    if move == "create":
        key = f"c{trial}"
        return bool(store.conditional_batch([Condition(key, None)], [Put(key, me)]))
    if move == "create-in-batches":
        key = f"c{trial}"
        results = store.conditional_batches(
            [
                ([], [Put(f"pre{trial}-{index}", b"")]),
                ([Condition(key, None)], [Put(key, me), Put(f"side{trial}-{index}", b"")]),
            ]
        )
        assert results[0] is True
        return bool(results[1])
    if move == "skew":
        # Each racer requires both keys absent but writes only one: the other key is "required
        # absent and not written", the case a row lock cannot cover.
        mine, other = (f"g{trial}", f"w{trial}") if index % 2 else (f"w{trial}", f"g{trial}")
        return bool(
            store.conditional_batch(
                [Condition(other, None), Condition(mine, None)], [Put(mine, me)]
            )
        )
    if move == "renew":
        key = f"r{trial}"
        if index % 2:
            return bool(
                store.conditional_batches([([Condition(key, b"start")], [Put(key, me)])])[0]
            )
        return bool(
            store.conditional_batch(
                [Condition(key, b"start"), Condition(f"none{trial}", None)], [Put(key, me)]
            )
        )
    if move == "release":
        # Two conditions expecting bytes, a put and a delete; every other racer requires a key
        # absent too (its claim upsert writes that key, then deletes it).
        key, other = f"a{trial}", f"b{trial}"
        extra = [Condition(f"none{trial}", None)] if index % 2 else []
        return bool(
            store.conditional_batch(
                [Condition(key, b"start"), Condition(other, b"start"), *extra],
                [Put(key, me), Delete(other)],
            )
        )
    raise AssertionError(f"unknown move {move!r}")


def _open_racer(kind: str, url: str, table: str) -> _Cas:
    if kind == "real":
        return PostgresStorage(url, table=table, max_size=4)
    return NaiveCas(url, table, claim_written=(kind == "naive-claiming"))


def _race(store: _Cas, move: str, trials: int, index: int, barrier: Any) -> list[int]:
    won = []
    for trial in range(trials):
        barrier.wait(_WAIT_S)
        if _attempt(store, move, trial, index):
            won.append(trial)
    return won


def _race_in_process(
    kind: str, url: str, table: str, move: str, trials: int, index: int, barrier: Any, out: Any
) -> None:
    try:
        store = _open_racer(kind, url, table)
        try:
            out.put((index, _race(store, move, trials, index, barrier)))
        finally:
            store.close()
    except BaseException as exc:
        barrier.abort()
        out.put((index, f"{type(exc).__name__}: {exc}"))
        raise


def run_race(
    kind: str, url: str, table: str, move: str, *, trials: int, threads: int, processes: int
) -> dict[int, list[int]]:
    """Race ``threads`` threads and ``processes`` processes through ``trials`` trials of ``move``.

    Every trial starts all racers at a barrier. Returns, per trial, the indexes of the winners.
    """
    ctx = multiprocessing.get_context("spawn")
    parties = threads + processes
    barrier = ctx.Barrier(parties)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_race_in_process,
            args=(kind, url, table, move, trials, threads + i, barrier, out),
            name=f"racer-{threads + i}",
        )
        for i in range(processes)
    ]
    stores = [_open_racer(kind, url, table) for _ in range(threads)]
    results: dict[int, list[int] | str] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = _race(stores[index], move, trials, index, barrier)
        except BaseException as exc:
            barrier.abort()
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,), name=f"racer-{i}") for i in range(threads)]
    try:
        for proc in procs:
            proc.start()
        for worker in workers:
            worker.start()
        for _ in procs:
            index, result = out.get(timeout=60)
            results[index] = result
    except BaseException:
        barrier.abort()
        raise
    finally:
        for worker in workers:
            if worker.ident is not None:
                worker.join(timeout=60)
        for proc in procs:
            if proc.pid is None:
                continue
            proc.join(timeout=60)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for store in stores:
            store.close()
        out.close()
        out.join_thread()
    for exc in errors:
        raise exc
    failed = {i: r for i, r in results.items() if isinstance(r, str)}
    assert not failed, f"racer processes failed: {failed}"
    winners: dict[int, list[int]] = {trial: [] for trial in range(trials)}
    for index, won in results.items():
        assert not isinstance(won, str)
        for trial in won:
            winners[trial].append(index)
    return winners


# -- atomicity -------------------------------------------------------------------------------


def test_racing_creates_from_threads_and_processes_have_exactly_one_winner_per_key(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    store = make_store()
    winners = run_race(
        "real", postgres_base_url, table, "create", trials=120, threads=4, processes=2
    )
    for trial, won in winners.items():
        assert len(won) == 1, f"trial {trial}: winners {won}"
        assert store.get(f"c{trial}") == _me(won[0])


def test_naive_lock_then_upsert_lets_several_racers_win_the_same_create(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    make_store()
    winners = run_race(
        "naive", postgres_base_url, table, "create", trials=20, threads=4, processes=2
    )
    assert any(len(won) > 1 for won in winners.values())


def test_racing_creates_inside_conditional_batches_roll_back_only_the_losing_batch(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    store = make_store()
    winners = run_race(
        "real", postgres_base_url, table, "create-in-batches", trials=60, threads=4, processes=1
    )
    for trial, won in winners.items():
        assert len(won) == 1, f"trial {trial}: winners {won}"
        assert store.get(f"c{trial}") == _me(won[0])
        assert _keys(store.scan(f"side{trial}-")) == [f"side{trial}-{won[0]}"]
        assert len(store.scan(f"pre{trial}-")) == 5


def test_required_absent_but_unwritten_keys_cannot_be_skewed_by_a_concurrent_insert(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    store = make_store()
    winners = run_race("real", postgres_base_url, table, "skew", trials=120, threads=4, processes=0)
    for trial, won in winners.items():
        assert len(won) == 1, f"trial {trial}: winners {won}"
        written = {store.get(f"g{trial}"), store.get(f"w{trial}")}
        assert written == {None, _me(won[0])}


def test_checking_unwritten_absent_keys_without_claiming_them_lets_two_racers_win(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    make_store()
    winners = run_race(
        "naive-claiming", postgres_base_url, table, "skew", trials=40, threads=4, processes=0
    )
    assert any(len(won) > 1 for won in winners.values())


def test_fast_path_renewal_races_general_path_takeover_with_one_winner(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    store = make_store()
    store.batch([Put(f"r{trial}", b"start") for trial in range(100)])
    winners = run_race(
        "real", postgres_base_url, table, "renew", trials=100, threads=4, processes=0
    )
    for trial, won in winners.items():
        assert len(won) == 1, f"trial {trial}: winners {won}"
        assert store.get(f"r{trial}") == _me(won[0])
    assert store.scan("none") == []


def test_batches_on_rows_that_exist_race_with_one_winner(
    postgres_base_url: str, make_store: Callable[..., PostgresStorage], table: str
) -> None:
    store = make_store()
    store.batch([Put(f"{k}{trial}", b"start") for trial in range(100) for k in "ab"])
    winners = run_race(
        "real", postgres_base_url, table, "release", trials=100, threads=4, processes=2
    )
    for trial, won in winners.items():
        assert len(won) == 1, f"trial {trial}: winners {won}"
        assert store.get_many([f"a{trial}", f"b{trial}"]) == [_me(won[0]), None]
    assert store.scan("none") == []


@pytest.mark.parametrize("theirs", [b"start", b"moved"])
def test_a_batch_judges_a_row_it_waited_for_as_committed(
    postgres_base_url: str,
    make_store: Callable[..., PostgresStorage],
    raw: psycopg.Connection[Any],
    table: str,
    theirs: bytes,
) -> None:
    """A batch whose row another transaction holds waits for it, then judges (and writes) the
    row as that transaction committed it, never as it stood when the call began."""
    store = make_store()
    store.batch([Put("k", b"old"), Put("e", b"entry")])
    result: list[bool] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(
                store.conditional_batch([Condition("k", b"start")], [Put("k", b"w"), Delete("e")])
            )
        except BaseException as exc:
            errors.append(exc)

    with psycopg.connect(postgres_base_url) as writer:
        writer.execute(f'UPDATE "{table}" SET value = %s WHERE key = %s', [theirs, "k"])
        worker = threading.Thread(target=run, name="cas-under-test")
        worker.start()
        try:
            _wait_until_blocked_on_a_lock(raw, worker)
        finally:
            writer.commit()
            worker.join(_WAIT_S)
    for exc in errors:
        raise exc
    if theirs == b"start":
        assert result == [True]
        assert store.get_many(["k", "e"]) == [b"w", None]
    else:
        assert result == [False]
        assert store.get_many(["k", "e"]) == [b"moved", b"entry"]


@pytest.mark.parametrize("n", [1, SCALARS_UP_TO, SCALARS_UP_TO + 1, 3 * SCALARS_UP_TO])
def test_batches_send_short_lists_as_scalars_and_long_ones_as_arrays_alike(
    make_store: Callable[..., PostgresStorage], n: int
) -> None:
    """Every batch shape behaves the same whether its lists go out as scalar parameters (up to
    SCALARS_UP_TO) or as arrays (longer): locks, claim upserts, upserts and deletes."""
    store = make_store()
    held = [f"h{i:02d}" for i in range(n)]
    gone = [f"g{i:02d}" for i in range(n)]
    new = [f"n{i:02d}" for i in range(n)]
    store.batch([Put(k, k.encode()) for k in held + gone])
    # Conditions on held keys, puts (to held and new keys) and deletes.
    conditions = [Condition(k, k.encode()) for k in held]
    writes: list[Operation] = [Put(k, b"w") for k in held + new]
    writes += [Delete(k) for k in gone]
    assert not store.conditional_batch([*conditions[:-1], Condition(held[-1], b"no")], writes)
    assert store.get_many(held + gone + new) == [k.encode() for k in held + gone] + [None] * n
    assert store.conditional_batch(conditions, writes)
    assert store.get_many(held + gone + new) == [b"w"] * n + [None] * n + [b"w"] * n
    assert store.conditional_batch([Condition(held[0], b"w")], [])

    # A transaction: read, then a batch requiring keys absent, claimed by the upsert.
    def decide(values: list[bytes | None]) -> tuple[list[Condition], list[Put]]:
        assert values == [b"w"] * n + [None] * n
        return [Condition(k, None) for k in gone], [Put(k, b"c") for k in gone + held]

    assert store.read_then_write(held + gone, decide) == ([b"w"] * n + [None] * n, True)
    assert store.get_many(held + gone) == [b"c"] * (2 * n)
    # A claim of absent keys and one present key fails and writes nothing.
    fresh = [f"f{i:02d}" for i in range(n)]
    claim = [Condition(k, None) for k in [*fresh, held[0]]]
    assert not store.conditional_batch(claim, [Put(k, b"x") for k in fresh])
    assert store.get_many(fresh) == [None] * n
    assert store.conditional_batch(claim[:-1], [Put(k, b"x") for k in fresh])
    assert store.get_many(fresh) == [b"x"] * n
    # A plain batch of puts and deletes.
    store.batch([*(Put(k, b"b") for k in new), *(Delete(k) for k in fresh)])
    assert store.get_many(new + fresh) == [b"b"] * n + [None] * n


# -- deterministic interleavings with a concurrent uncommitted insert ------------------------


def _wait_until_blocked_on_a_lock(raw: psycopg.Connection[Any], worker: threading.Thread) -> None:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        (waiting,) = raw.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone() or (0,)
        if waiting:
            return
        assert worker.is_alive(), "the call finished without waiting for the concurrent insert"
        time.sleep(0.01)
    raise AssertionError("the call never waited for the concurrent insert")


def _call_while_a_concurrent_insert_is_pending(
    postgres_base_url: str,
    raw: psycopg.Connection[Any],
    table: str,
    key: str,
    call: Callable[[], object],
    *,
    commit: bool,
) -> object:
    """Hold an uncommitted insert of ``key`` while ``call`` runs; end it once ``call`` waits."""
    result: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            errors.append(exc)

    with psycopg.connect(postgres_base_url) as inserter:
        inserter.execute(f'INSERT INTO "{table}" VALUES (%s, %s)', [key, b"theirs"])
        worker = threading.Thread(target=run, name="cas-under-test")
        worker.start()
        try:
            _wait_until_blocked_on_a_lock(raw, worker)
        finally:
            inserter.commit() if commit else inserter.rollback()
            worker.join(_WAIT_S)
    for exc in errors:
        raise exc
    return result[0]


def test_create_loses_to_an_insert_that_commits_after_its_check(
    postgres_base_url: str,
    make_store: Callable[..., PostgresStorage],
    raw: psycopg.Connection[Any],
    table: str,
) -> None:
    store = make_store()
    committed = _call_while_a_concurrent_insert_is_pending(
        postgres_base_url,
        raw,
        table,
        "k",
        lambda: store.conditional_batch([Condition("k", None)], [Put("k", b"mine"), Put("x", b"")]),
        commit=True,
    )
    assert committed is False
    assert store.scan() == [("k", b"theirs")]


def test_losing_create_in_conditional_batches_rolls_back_to_its_savepoint_only(
    postgres_base_url: str,
    make_store: Callable[..., PostgresStorage],
    raw: psycopg.Connection[Any],
    table: str,
) -> None:
    store = make_store()
    results = _call_while_a_concurrent_insert_is_pending(
        postgres_base_url,
        raw,
        table,
        "k",
        lambda: store.conditional_batches(
            [
                ([], [Put("before", b"1")]),
                ([Condition("k", None)], [Put("k", b"mine"), Put("side", b"")]),
                ([Condition("k", b"theirs")], [Put("after", b"2")]),
            ]
        ),
        commit=True,
    )
    assert results == [True, False, True]
    assert store.scan() == [("after", b"2"), ("before", b"1"), ("k", b"theirs")]


@pytest.mark.parametrize("commit", [True, False], ids=["insert-commits", "insert-rolls-back"])
def test_required_absent_unwritten_key_waits_for_a_pending_insert_of_it(
    postgres_base_url: str,
    make_store: Callable[..., PostgresStorage],
    raw: psycopg.Connection[Any],
    table: str,
    commit: bool,
) -> None:
    store = make_store()
    committed = _call_while_a_concurrent_insert_is_pending(
        postgres_base_url,
        raw,
        table,
        "guard",
        lambda: store.conditional_batch([Condition("guard", None)], [Put("out", b"mine")]),
        commit=commit,
    )
    if commit:
        assert committed is False
        assert store.scan() == [("guard", b"theirs")]
    else:
        assert committed is True
        assert store.scan() == [("out", b"mine")]


# -- renewal fast path -----------------------------------------------------------------------


def test_renewal_shaped_batches_report_each_outcome(
    make_store: Callable[..., PostgresStorage],
) -> None:
    store = make_store()
    store.batch([Put("a", b"1"), Put("b", b"1"), Put("c", b"")])
    results = store.conditional_batches(
        [
            ([Condition("b", b"1")], [Put("b", b"2")]),
            ([Condition("a", b"wrong")], [Put("a", b"2")]),
            ([Condition("missing", b"1")], [Put("missing", b"2")]),
            ([Condition("c", b"")], [Put("c", b"3")]),
            ([Condition("a", b"11")], [Put("a", b"4")]),
        ]
    )
    assert results == [True, False, False, True, False]
    assert store.scan() == [("a", b"1"), ("b", b"2"), ("c", b"3")]


def test_renewal_shaped_batches_match_a_sequential_model_over_many_keys(
    make_store: Callable[..., PostgresStorage],
) -> None:
    store = make_store()
    model = {f"k{i:04d}": f"v{i}".encode() for i in range(0, 600, 2)}
    store.batch([Put(k, v) for k, v in model.items()])
    batches: list[tuple[list[Condition], list[Operation]]] = []
    expected = []
    for i in range(600):
        key = f"k{i:04d}"
        stored = model.get(key)
        guess = stored if stored is not None and i % 3 else f"v{i}x".encode()
        batches.append(([Condition(key, guess)], [Put(key, f"n{i}".encode())]))
        expected.append(guess == stored)
        if guess == stored:
            model[key] = f"n{i}".encode()
    assert store.conditional_batches(batches) == expected
    assert dict(store.scan()) == model


def test_renewal_shaped_batches_on_a_repeated_key_apply_one_after_another(
    make_store: Callable[..., PostgresStorage],
) -> None:
    store = make_store()
    store.put("k", b"a")
    results = store.conditional_batches(
        [
            ([Condition("k", b"a")], [Put("k", b"b")]),
            ([Condition("k", b"b")], [Put("k", b"c")]),
            ([Condition("k", b"a")], [Put("k", b"d")]),
            ([Condition("other", b"x")], [Put("other", b"y")]),
        ]
    )
    assert results == [True, True, False, False]
    assert store.scan() == [("k", b"c")]


def test_single_renewal_shaped_conditional_batch_compares_exact_bytes(
    make_store: Callable[..., PostgresStorage],
) -> None:
    store = make_store()
    store.put("k", b"abc")
    assert store.conditional_batch([Condition("k", b"ab")], [Put("k", b"x")]) is False
    assert store.conditional_batch([Condition("k", b"abc")], [Put("k", b"x")]) is True
    assert store.conditional_batch([Condition("gone", b"abc")], [Put("gone", b"x")]) is False
    assert store.scan() == [("k", b"x")]


# -- schema ----------------------------------------------------------------------------------


def test_table_is_created_with_c_collation_so_scans_follow_byte_order(
    make_store: Callable[..., PostgresStorage], raw: psycopg.Connection[Any], table: str
) -> None:
    store = make_store()
    keys = ["Z", "a", "\u00e9", "e", "\u00c9", "\uff21", "\U0001f600", "\ue000", "~"]
    store.batch([Put(k, b"") for k in keys])
    by_bytes = sorted(keys, key=lambda k: k.encode("utf-8"))
    assert [k for k, _ in store.scan()] == by_bytes
    assert [k for k, _ in store.scan(reverse=True)] == by_bytes[::-1]
    row = raw.execute(
        "SELECT co.collname FROM pg_attribute a JOIN pg_collation co ON co.oid = a.attcollation "
        "WHERE a.attrelid = %s::regclass AND a.attname = 'key'",
        [f'"{table}"'],
    ).fetchone()
    assert row == ("C",)


def test_existing_table_with_a_linguistic_key_collation_is_refused(
    postgres_base_url: str, raw: psycopg.Connection[Any], table: str
) -> None:
    if raw.execute("SELECT 1 FROM pg_collation WHERE collname = 'und-x-icu'").fetchone() is None:
        pytest.skip("this server has no ICU collations")
    raw.execute(
        f'CREATE TABLE "{table}" (key TEXT COLLATE "und-x-icu" PRIMARY KEY, value BYTEA NOT NULL)'
    )
    with pytest.raises(StorageError, match="und-x-icu"):
        PostgresStorage(postgres_base_url, table=table)


def test_many_openers_creating_the_same_table_at_once_all_succeed(
    postgres_base_url: str, table: str
) -> None:
    start = threading.Barrier(6)
    stores: list[PostgresStorage] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            start.wait(_WAIT_S)
            stores.append(PostgresStorage(postgres_base_url, table=table))
        except BaseException as exc:
            errors.append(exc)

    openers = [threading.Thread(target=open_one, name=f"opener-{i}") for i in range(6)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(_WAIT_S)
    try:
        for exc in errors:
            raise exc
        stores[0].put("k", b"v")
        assert all(store.get("k") == b"v" for store in stores)
    finally:
        for store in stores:
            store.close()


# -- server restarts -------------------------------------------------------------------------


def test_calls_succeed_again_after_a_server_restart(private_cluster: PostgresCluster) -> None:
    with PostgresStorage(private_cluster.url, table="t", min_size=2, timeout=2.0) as store:
        store.put("k", b"before")
        private_cluster.stop(remove=False)
        with pytest.raises(StorageError) as raised:
            store.get("k")
        assert isinstance(raised.value.__cause__, psycopg.Error)
        private_cluster.start()
        deadline = time.monotonic() + _WAIT_S
        while True:
            try:
                value = store.get("k")
                break
            except StorageError:
                assert time.monotonic() < deadline, "the store never recovered"
        assert value == b"before"
        assert store.conditional_batch([Condition("k", b"before")], [Put("k", b"after")])
        private_cluster.restart()
        deadline = time.monotonic() + _WAIT_S
        while True:
            try:
                value = store.get("k")
                break
            except StorageError:
                assert time.monotonic() < deadline, "the store never recovered"
        assert value == b"after"
        store.batch([Put("k2", b"x"), Delete("k")])
        assert store.scan() == [("k2", b"x")]


def test_a_read_on_a_connection_the_server_dropped_runs_again_on_a_checked_one(
    postgres_base_url: str,
    table: str,
    raw: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = "weft_" + uuid.uuid4().hex[:12]
    url = _with_params(postgres_base_url, application_name=app)
    reads: list[tuple[str, Callable[[PostgresStorage], object], object]] = [
        ("get", lambda s: s.get("k"), b"v"),
        ("get_many", lambda s: s.get_many(["k", "absent"]), [b"v", None]),
        ("scan", lambda s: s.scan("k"), [("k", b"v")]),
    ]
    with PostgresStorage(url, table=table, min_size=1, max_size=1) as store:
        store.put("k", b"v")
        for name, read, expected in reads:
            dropped = raw.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name LIKE %s",
                [f"{app} %"],
            ).fetchone()
            assert dropped == (1,)
            caplog.clear()
            with caplog.at_level("DEBUG", logger="weft_sync.storage.postgres.store"):
                assert read(store) == expected
            assert any(f"{name} failed on a pooled connection" in m for m in caplog.messages)
        # A write on a dropped session fails at its BEGIN, before writing anything, and starts
        # again on a checked connection.
        raw.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"{app} %"],
        )
        caplog.clear()
        with caplog.at_level("DEBUG", logger="weft_sync.storage.postgres.store"):
            # Not renewal-shaped (two puts): it runs in a transaction.
            assert store.conditional_batch([Condition("k", b"v")], [Put("k", b"w"), Put("j", b"")])
        assert any("BEGIN failed on a pooled connection" in m for m in caplog.messages)
        assert store.get("k") == b"w"
        raw.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"{app} %"],
        )
        decided: list[list[bytes | None]] = []

        def decide(values: list[bytes | None]) -> tuple[list[Condition], list[Put]]:
            decided.append(values)
            return [Condition("k", values[0])], [Put("k", b"x")]

        caplog.clear()
        with caplog.at_level("DEBUG", logger="weft_sync.storage.postgres.store"):
            assert store.read_then_write(["k"], decide) == ([b"w"], True)
        assert any("BEGIN failed on a pooled connection" in m for m in caplog.messages)
        assert decided == [[b"w"]] and store.get("k") == b"x"


# -- errors and lifecycle --------------------------------------------------------------------


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://postgres@/postgres?host=/nonexistent/weft-sync-socket-dir",
        "postgresql://postgres@127.0.0.1:1/postgres",
    ],
    ids=["missing-socket", "refused-port"],
)
def test_unreachable_server_raises_storage_error_quickly(dsn: str) -> None:
    started = time.monotonic()
    with pytest.raises(StorageError) as raised:
        PostgresStorage(dsn, table="t", timeout=2.0)
    assert time.monotonic() - started < 10
    assert isinstance(raised.value.__cause__, psycopg.Error)


@pytest.mark.parametrize(("min_size", "max_size"), [(0, 4), (5, 4), (-1, 1), (3, 2)])
def test_bad_pool_sizes_are_refused_naming_both(min_size: int, max_size: int) -> None:
    with pytest.raises(ValueError, match=f"min_size={min_size} and max_size={max_size}"):
        PostgresStorage("postgresql://nowhere", min_size=min_size, max_size=max_size)


def test_non_integer_pool_size_and_bad_timeout_are_refused() -> None:
    with pytest.raises(TypeError, match=r"1\.5"):
        PostgresStorage("postgresql://nowhere", min_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"timeout.*got 0"):
        PostgresStorage("postgresql://nowhere", timeout=0)


@pytest.mark.parametrize("name", ["t; DROP TABLE x", 'a"b', "1abc", "", "x" * 64])
def test_table_names_that_are_not_plain_identifiers_are_refused(
    postgres_base_url: str, name: str
) -> None:
    with pytest.raises(ValueError, match="invalid table name"):
        PostgresStorage(postgres_base_url, table=name)


def test_driver_errors_during_a_call_become_storage_errors(
    make_store: Callable[..., PostgresStorage], raw: psycopg.Connection[Any], table: str
) -> None:
    store = make_store()
    store.put("k", b"v")
    raw.execute(f'DROP TABLE "{table}"')
    calls: list[Callable[[], object]] = [
        lambda: store.get("k"),
        lambda: store.scan(),
        lambda: store.batch([Put("a", b""), Delete("b")]),
        lambda: store.conditional_batch([Condition("k", None)], [Put("k", b"")]),
        lambda: store.conditional_batches([([Condition("k", b"v")], [Put("k", b"w")])]),
    ]
    for call in calls:
        with pytest.raises(StorageError, match=table) as raised:
            call()
        assert isinstance(raised.value.__cause__, psycopg.errors.UndefinedTable)


def test_use_after_close_raises_closed_error_on_every_path(
    make_store: Callable[..., PostgresStorage],
) -> None:
    store = make_store()
    store.put("k", b"v")
    store.close()
    with pytest.raises(ClosedError):
        store.conditional_batches([([Condition("k", b"v")], [Put("k", b"w")])])
    with pytest.raises(ClosedError):
        store.conditional_batch([Condition("k", None)], [Put("k", b"w")])
    with pytest.raises(ClosedError):
        store.scan("k", limit=1)
    store.close()


def test_open_storage_routes_postgresql_urls_with_pool_and_table_params(
    postgres_base_url: str, table: str
) -> None:
    url = _with_params(postgres_base_url, table=table, min_size=2, max_size=3)
    with open_storage(url) as store:
        assert isinstance(store, PostgresStorage)
        store.put("k", b"v")
    with PostgresStorage(postgres_base_url, table=table) as direct:
        assert direct.get("k") == b"v"
    with pytest.raises(ValueError, match="min_size=3 and max_size=2"):
        open_storage(_with_params(postgres_base_url, table=table, min_size=3, max_size=2))


# -- fork safety -----------------------------------------------------------------------------


def _backend_pids(raw: psycopg.Connection[Any], app: str) -> set[int]:
    rows = raw.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", [f"{app} %"]
    ).fetchall()
    return {int(row[0]) for row in rows}


def test_forked_child_refuses_the_inherited_pool_and_leaves_the_parents_sessions_alone(
    postgres_base_url: str, raw: psycopg.Connection[Any], table: str
) -> None:
    app = "weft-fork-" + uuid.uuid4().hex[:8]
    dsn = _with_params(postgres_base_url, application_name=app)
    with PostgresStorage(dsn, table=table, min_size=2) as store:
        store.put("parent", b"1")
        deadline = time.monotonic() + _WAIT_S
        while len(_backend_pids(raw, app)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        parents = _backend_pids(raw, app)
        with expected_fork_warning():
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                try:
                    store.get("parent")
                except ClosedError as exc:
                    code = 0 if "inherited across os.fork()" in str(exc) else 4
                store.close()  # must not close the parent's sessions
                with PostgresStorage(dsn, table=table, min_size=1) as own:
                    if code == 0 and own.get("parent") == b"1":
                        own.put("child", b"2")
                    else:
                        code = code or 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The child's own sessions end when it closes; the parent's must outlive the child.
        deadline = time.monotonic() + _WAIT_S
        while _backend_pids(raw, app) != parents:
            assert time.monotonic() < deadline, f"{_backend_pids(raw, app)} != {parents}"
            time.sleep(0.01)
        assert store.get("child") == b"2"
        assert _keys(store.scan()) == ["child", "parent"]


def test_forked_child_refuses_every_conditional_write_before_checking_its_arguments(
    postgres_base_url: str, table: str
) -> None:
    # The arguments are invalid on purpose: the inherited-store error must come first.
    calls: dict[str, Callable[[PostgresStorage], object]] = {
        "conditional_batch": lambda store: store.conditional_batch("bad", []),  # type: ignore[arg-type]
        "conditional_batches": lambda store: store.conditional_batches("bad"),  # type: ignore[arg-type]
        "compare_and_set_many": lambda store: store.compare_and_set_many("bad"),  # type: ignore[arg-type]
    }
    with PostgresStorage(postgres_base_url, table=table) as store:
        with expected_fork_warning():
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                for index, (name, call) in enumerate(calls.items()):
                    try:
                        call(store)
                        code = code or 10 + index
                    except ClosedError as exc:
                        if f"PostgresStorage.{name}() was called" not in str(exc):
                            code = code or 20 + index
                    except Exception:
                        code = code or 30 + index
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.conditional_batches([]) == []  # the parent's store is untouched


def _keys(rows: list[tuple[str, bytes]]) -> list[str]:
    return [key for key, _ in rows]
