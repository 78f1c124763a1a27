"""read_then_write: the read and the write of one decision in one transaction, on every backend.

Each test runs on the native method of SQLite and PostgreSQL and, where it makes sense, through
the fallback (a store seen without the method: a read, then a conditional batch), which must
give the same outcome.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.claims.gated import GatedStorage
from weft_sync.errors import StorageCapabilityError
from weft_sync.storage import Condition, Delete, Put, SqliteStorage, Storage
from weft_sync.storage.base import Operation
from weft_sync.storage.read_then_write import Decision, storage_read_then_write


class WithoutReadThenWrite:
    """A real store seen without ``read_then_write``: the helper takes the fallback path."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "read_then_write":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.fixture(params=["native", "fallback"])
def view(request: pytest.FixtureRequest, storage: Storage) -> Storage:
    """The store under test, natively or through the fallback."""
    if request.param == "native":
        assert callable(getattr(storage, "read_then_write", None))
        return storage
    return WithoutReadThenWrite(storage)  # type: ignore[return-value]


def _bump(seen: list[list[bytes | None]]) -> Callable[[list[bytes | None]], Decision]:
    """A decision: conditioned on the values read, write ``counter`` + 1 and a log entry."""

    def decide(values: list[bytes | None]) -> Decision:
        seen.append(values)
        (counter,) = values
        after = 1 if counter is None else int(counter) + 1
        ops: list[Operation] = [Put("counter", b"%d" % after), Put(f"log/{after}", b"x")]
        return [Condition("counter", counter)], ops

    return decide


def test_decide_sees_the_stored_values_in_key_order_and_its_batch_commits(view: Storage) -> None:
    view.put("b", b"B")
    seen: list[list[bytes | None]] = []

    def decide(values: list[bytes | None]) -> Decision:
        seen.append(values)
        return [Condition("a", None), Condition("b", b"B")], [Put("a", b"A"), Delete("b")]

    values, committed = storage_read_then_write(view, ["a", "b", "a"], decide)
    assert seen == [[None, b"B", None]] and values == [None, b"B", None]
    assert committed is True
    assert (view.get("a"), view.get("b")) == (b"A", None)


def test_a_decision_of_none_writes_nothing(view: Storage) -> None:
    view.put("k", b"v")
    values, committed = storage_read_then_write(view, ["k"], lambda values: None)
    assert (values, committed) == ([b"v"], False)
    assert [key for key, _ in view.scan()] == ["k"]


def test_a_condition_on_a_key_read_is_judged_against_the_value_read(view: Storage) -> None:
    view.put("k", b"stored")

    def decide(values: list[bytes | None]) -> Decision:
        return [Condition("k", b"something else")], [Put("k", b"new"), Put("also", b"x")]

    assert storage_read_then_write(view, ["k"], decide) == ([b"stored"], False)
    assert (view.get("k"), view.get("also")) == (b"stored", None)


def test_a_failed_condition_on_a_key_not_read_writes_nothing(view: Storage) -> None:
    view.put("other", b"now")

    def decide(values: list[bytes | None]) -> Decision:
        return [Condition("other", b"before")], [Put("k", b"v")]

    assert storage_read_then_write(view, ["k"], decide) == ([None], False)
    assert view.get("k") is None


def test_what_decide_raises_reaches_the_caller_and_nothing_is_written(view: Storage) -> None:
    def decide(values: list[bytes | None]) -> Decision:
        raise LookupError("no decision for these values")

    with pytest.raises(LookupError, match="no decision"):
        storage_read_then_write(view, ["k"], decide)
    assert view.scan() == []
    # The store goes on working.
    seen: list[list[bytes | None]] = []
    assert storage_read_then_write(view, ["counter"], _bump(seen)) == ([None], True)
    assert view.get("counter") == b"1"


def test_a_bad_batch_from_decide_is_refused_before_any_write(view: Storage) -> None:
    def decide(values: list[bytes | None]) -> Decision:
        return [], [Put("good", b"v"), Put("bad", "text")]  # type: ignore[arg-type]

    with pytest.raises(TypeError):
        storage_read_then_write(view, ["k"], decide)
    assert view.scan() == []


@pytest.mark.parametrize("bad", ["k", [1], ["a\x00b"]])
def test_bad_keys_are_refused_before_decide_runs(view: Storage, bad: Any) -> None:
    called: list[object] = []
    with pytest.raises((TypeError, ValueError)):
        storage_read_then_write(view, bad, lambda values: called.append(values))  # type: ignore[func-returns-value]
    assert called == []


def test_concurrent_decisions_on_one_counter_lose_no_increment(
    open_store: Callable[[], Storage],
) -> None:
    # Two instances (two connections, as two processes would have), four threads each: every
    # committed decision read the value the previous one wrote.
    stores = [open_store(), open_store()]
    per_thread = 15
    failures: list[BaseException] = []
    commits: list[int] = []

    def work(store: Storage) -> None:
        try:
            done = 0
            while done < per_thread:
                seen: list[list[bytes | None]] = []
                if storage_read_then_write(store, ["counter"], _bump(seen))[1]:
                    done += 1
            commits.append(done)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures[0]
    total = sum(commits)
    assert total == 8 * per_thread
    assert stores[0].get("counter") == b"%d" % total
    assert sorted(k for k, _ in stores[0].scan("log/")) == sorted(
        f"log/{n}" for n in range(1, total + 1)
    )


def test_a_store_without_conditional_batch_is_refused_before_any_read(storage: Storage) -> None:
    called: list[object] = []
    no_cas = GatedStorage(storage, conditional_batch=False)
    with pytest.raises(StorageCapabilityError, match="conditional_batch"):
        storage_read_then_write(no_cas, ["k"], lambda values: called.append(values))  # type: ignore[func-returns-value]
    assert called == [] and no_cas.calls["get"] == 0


# -- the read is inside the write transaction ---------------------------------------------------


def test_sqlite_decide_runs_under_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with SqliteStorage(path, table="kv") as store:
        store.put("k", b"0")
        other = sqlite3.connect(path, isolation_level=None, timeout=0)
        outcome: list[str] = []

        def decide(values: list[bytes | None]) -> Decision:
            try:
                other.execute("UPDATE kv SET value = x'31' WHERE key = 'k'")
                outcome.append("written")
            except sqlite3.OperationalError as exc:
                outcome.append(str(exc))
            return [Condition("k", values[0])], [Put("k", b"2")]

        try:
            assert store.read_then_write(["k"], decide) == ([b"0"], True)
        finally:
            other.close()
        assert outcome == ["database is locked"]
        assert store.get("k") == b"2"


def test_sqlite_a_raising_decide_in_a_group_commit_spares_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SqliteStorage(tmp_path / "store.db", table="kv") as store:
        store.put("warm", b"v")  # the writer and its connection exist
        writer = store._writer
        assert writer is not None
        entered, release = threading.Event(), threading.Event()
        original = store._file_lock.hold
        first = [True]

        def hold() -> Any:
            if first[0]:
                first[0] = False
                entered.set()
                assert release.wait(timeout=30)
            return original()

        monkeypatch.setattr(store._file_lock, "hold", hold)
        results: dict[str, object] = {}

        def run(name: str, fn: Callable[[], object]) -> threading.Thread:
            def body() -> None:
                try:
                    results[name] = fn()
                except BaseException as exc:
                    results[name] = exc

            thread = threading.Thread(target=body, name=name)
            thread.start()
            return thread

        def boom(values: list[bytes | None]) -> Decision:
            raise LookupError("boom")

        def fine(values: list[bytes | None]) -> Decision:
            return [Condition("b", None)], [Put("b", b"B")]

        threads = [run("first", lambda: store.put("first", b"v"))]
        assert entered.wait(timeout=10)
        threads.append(run("boom", lambda: store.read_then_write(["a"], boom)))
        threads.append(run("fine", lambda: store.read_then_write(["b"], fine)))
        threads.append(run("put", lambda: store.put("c", b"C")))
        deadline = threading.Event()
        for _ in range(500):
            if store._queue.qsize() == 3:
                break
            deadline.wait(0.01)
        assert store._queue.qsize() == 3
        release.set()
        for thread in threads:
            thread.join(timeout=30)
        assert writer.group_commits == 1
        assert isinstance(results["boom"], LookupError)
        assert results["fine"] == ([None], True)
        assert (store.get("a"), store.get("b"), store.get("c")) == (None, b"B", b"C")


def _pg_url(base: str) -> tuple[str, str]:
    table = "t_" + uuid.uuid4().hex[:16]
    return f"{base}{'&' if '?' in base else '?'}table={table}", table


def test_postgres_decide_runs_with_the_rows_read_locked(postgres_base_url: str) -> None:
    from weft_sync.storage import open_storage

    url, table = _pg_url(postgres_base_url)
    with open_storage(url) as store:
        store.put("k", b"0")
        outcome: list[str] = []
        with psycopg.connect(postgres_base_url, autocommit=True) as other:
            other.execute("SET lock_timeout = '200ms'")

            def decide(values: Sequence[bytes | None]) -> Decision:
                try:
                    other.execute(f"UPDATE \"{table}\" SET value = '\\x31' WHERE key = 'k'")
                    outcome.append("written")
                except psycopg.errors.LockNotAvailable:
                    outcome.append("locked")
                return [Condition("k", values[0])], [Put("k", b"2")]

            assert storage_read_then_write(store, ["k"], decide) == ([b"0"], True)
        assert outcome == ["locked"]
        assert store.get("k") == b"2"


def test_postgres_an_absent_key_inserted_meanwhile_fails_the_decision(
    postgres_base_url: str,
) -> None:
    from weft_sync.storage import open_storage

    url, table = _pg_url(postgres_base_url)
    with open_storage(url) as store:
        store.put("warm", b"v")
        with psycopg.connect(postgres_base_url, autocommit=True) as other:

            def decide(values: Sequence[bytes | None]) -> Decision:
                # An absent row cannot be locked: another session inserts it now.
                other.execute(f"INSERT INTO \"{table}\" VALUES ('k', '\\x6f74686572')")
                return [Condition("k", None)], [Put("k", b"mine"), Put("also", b"x")]

            assert storage_read_then_write(store, ["k"], decide) == ([None], False)
        assert (store.get("k"), store.get("also")) == (b"other", None)
