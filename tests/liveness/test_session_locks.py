"""Session locks on both backends: held while the holder lives, gone when it dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.liveness.procs import POLL_S, WAIT_S, holding, reap
from tests.liveness.wrappers import WithoutSessionLocks
from tests.pgcluster import PostgresCluster
from tests.support.waiting import wait_until
from weft_sync.errors import ClosedError, StorageError
from weft_sync.storage import SqliteStorage, Storage
from weft_sync.storage.session_locks import (
    MAX_SESSION_LOCK_NAME_LENGTH,
    SupportsSessionLocks,
    storage_session_locks,
)
from weft_sync.storage.sqlite.locks import lock_directory


def _locks(storage: Storage) -> SupportsSessionLocks:
    locks = storage_session_locks(storage)
    assert locks is not None
    return locks


def test_both_backends_declare_session_locks(storage: Storage) -> None:
    assert storage.capabilities.session_locks is True
    assert storage_session_locks(storage) is storage


def test_a_wrapper_without_the_capability_gets_none(storage: Storage) -> None:
    assert storage_session_locks(WithoutSessionLocks(storage)) is None


class _CapabilitiesOnly:
    """Passes the inner store's capabilities through, but none of its session-lock methods."""

    def __init__(self, inner: Storage) -> None:
        self.capabilities = inner.capabilities


def test_a_wrapper_passing_capabilities_but_not_the_methods_gets_none(storage: Storage) -> None:
    wrapper = _CapabilitiesOnly(storage)
    assert wrapper.capabilities.session_locks is True
    assert storage_session_locks(wrapper) is None


def test_held_while_held_and_not_after_release(storage: Storage) -> None:
    locks = _locks(storage)
    lock = locks.acquire_session_lock("engine-a")
    assert lock.name == "engine-a"
    assert locks.held_session_locks(["engine-a", "engine-b"]) == {"engine-a"}
    assert lock.ensure() is True
    lock.release()
    lock.release()  # idempotent
    assert locks.held_session_locks(["engine-a"]) == set()
    assert lock.ensure() is False


def test_a_name_never_locked_is_not_held(storage: Storage) -> None:
    assert _locks(storage).held_session_locks(["nobody", "nobody/else"]) == set()
    assert _locks(storage).held_session_locks([]) == set()


def test_a_second_acquire_of_a_held_name_is_refused_naming_it(storage: Storage) -> None:
    locks = _locks(storage)
    lock = locks.acquire_session_lock("engine/1")
    try:
        with pytest.raises(StorageError, match="engine/1"):
            locks.acquire_session_lock("engine/1")
        assert locks.held_session_locks(["engine/1"]) == {"engine/1"}
    finally:
        lock.release()
    again = locks.acquire_session_lock("engine/1")  # free again once released
    again.release()


@pytest.mark.parametrize("bad", ["", "x" * (MAX_SESSION_LOCK_NAME_LENGTH + 1), "a\x00b", "\ud800"])
def test_bad_names_are_refused_naming_the_value(storage: Storage, bad: str) -> None:
    locks = _locks(storage)
    with pytest.raises(ValueError, match="session lock name"):
        locks.acquire_session_lock(bad)
    with pytest.raises(ValueError, match="session lock name"):
        locks.held_session_locks([bad])


def test_a_probe_of_a_lone_string_is_refused(storage: Storage) -> None:
    with pytest.raises(TypeError, match="collection of names"):
        _locks(storage).held_session_locks("engine-a")


def test_a_closed_store_refuses_session_locks(open_store: object, storage: Storage) -> None:
    locks = _locks(storage)
    storage.close()
    with pytest.raises(ClosedError):
        locks.acquire_session_lock("engine-a")
    with pytest.raises(ClosedError):
        locks.held_session_locks(["engine-a"])


def test_sigkill_of_the_holder_drops_the_lock(storage: Storage, storage_url: str) -> None:
    locks = _locks(storage)
    with holding(storage_url, "victim") as holder:
        assert locks.held_session_locks(["victim"]) == {"victim"}
        holder.signal(signal.SIGKILL)
        holder.proc.wait()
        wait_until(
            lambda: not locks.held_session_locks(["victim"]),
            "the lock is not held",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
    # The name is free for a new holder.
    lock = locks.acquire_session_lock("victim")
    lock.release()


def test_sigstop_keeps_the_lock_held(storage: Storage, storage_url: str) -> None:
    locks = _locks(storage)
    with holding(storage_url, "frozen") as holder:
        holder.signal(signal.SIGSTOP)
        for _ in range(20):
            assert locks.held_session_locks(["frozen"]) == {"frozen"}
        with pytest.raises(StorageError, match="frozen"):
            locks.acquire_session_lock("frozen")
        holder.signal(signal.SIGCONT)
        assert locks.held_session_locks(["frozen"]) == {"frozen"}


def test_a_forked_child_neither_drops_nor_keeps_the_parents_lock(
    storage: Storage, storage_url: str
) -> None:
    locks = _locks(storage)
    with holding(storage_url, "parent", mode="fork") as holder:
        sleeper = int(holder.line.split()[1])
        try:
            # One child has exited already: the parent still holds its lock.
            assert locks.held_session_locks(["parent"]) == {"parent"}
            holder.signal(signal.SIGKILL)
            holder.proc.wait()
            # The other child still runs, but closed its copy: the lock went with the parent.
            assert os.path.exists(f"/proc/{sleeper}")
            wait_until(
                lambda: not locks.held_session_locks(["parent"]),
                "the lock is not held",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
        finally:
            reap(sleeper)


def test_an_execed_child_does_not_inherit_the_lock(storage: Storage, storage_url: str) -> None:
    locks = _locks(storage)
    with holding(storage_url, "execer", mode="exec") as holder:
        sleeper = int(holder.line.split()[1])
        try:
            assert locks.held_session_locks(["execer"]) == {"execer"}
            holder.signal(signal.SIGKILL)
            holder.proc.wait()
            assert os.path.exists(f"/proc/{sleeper}")
            wait_until(
                lambda: not locks.held_session_locks(["execer"]),
                "the lock is not held",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
        finally:
            reap(sleeper)


# -- SQLite -----------------------------------------------------------------------------------


def test_sqlite_read_only_store_never_creates_the_lock_directory(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    SqliteStorage(path).close()
    with SqliteStorage(path, read_only=True) as ro:
        locks = _locks(ro)
        assert locks.held_session_locks(["a"]) == set()
        with pytest.raises(StorageError, match="read-only"):
            locks.acquire_session_lock("a")
        locks.forget_session_lock("a")
    assert not os.path.exists(lock_directory(str(path)))


def test_sqlite_release_removes_the_lock_file(tmp_path: Path) -> None:
    with SqliteStorage(tmp_path / "store.db") as store:
        lock = _locks(store).acquire_session_lock("engine-a")
        assert lock.token.startswith("flock:")
        directory = lock_directory(str(tmp_path / "store.db"))
        assert os.listdir(directory) == ["engine-a.lock"]
        lock.release()
        assert os.listdir(directory) == []


def test_sqlite_forget_removes_a_dead_holders_file_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with SqliteStorage(tmp_path / "store.db") as store:
        locks = _locks(store)
        directory = lock_directory(str(tmp_path / "store.db"))
        with holding(url, "dead") as holder:
            locks.forget_session_lock("dead")  # held: left alone
            assert "dead.lock" in os.listdir(directory)
            holder.signal(signal.SIGKILL)
            holder.proc.wait()
        wait_until(
            lambda: not locks.held_session_locks(["dead"]),
            "the lock is not held",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        assert "dead.lock" in os.listdir(directory)  # a dead holder cannot unlink its file
        locks.forget_session_lock("dead")
        assert os.listdir(directory) == []
        locks.forget_session_lock("dead")  # absent: a no-op


def test_sqlite_long_names_get_a_hashed_file_name(tmp_path: Path) -> None:
    with SqliteStorage(tmp_path / "store.db") as store:
        locks = _locks(store)
        names = ["é" * MAX_SESSION_LOCK_NAME_LENGTH, "é" * (MAX_SESSION_LOCK_NAME_LENGTH - 1)]
        held = [locks.acquire_session_lock(name) for name in names]
        assert locks.held_session_locks(names) == set(names)
        for lock in held:
            lock.release()
        assert locks.held_session_locks(names) == set()


def test_sqlite_ensure_retakes_a_lock_whose_file_was_removed(tmp_path: Path) -> None:
    with SqliteStorage(tmp_path / "store.db") as store:
        locks = _locks(store)
        lock = locks.acquire_session_lock("engine-a")
        directory = lock_directory(str(tmp_path / "store.db"))
        os.unlink(os.path.join(directory, "engine-a.lock"))
        os.rmdir(directory)
        assert locks.held_session_locks(["engine-a"]) == set()
        assert lock.ensure() is True
        assert locks.held_session_locks(["engine-a"]) == {"engine-a"}
        lock.release()


def test_sqlite_ensure_keeps_a_lock_whose_path_cannot_be_looked_up(tmp_path: Path) -> None:
    """The lock directory's path names a regular file for a while (a lookup fails with
    ``NotADirectoryError``): ``ensure()`` says not held, without raising, and keeps the lock on
    its file, which is found held again once the directory is back."""
    with SqliteStorage(tmp_path / "store.db") as store:
        locks = _locks(store)
        lock = locks.acquire_session_lock("engine-a")
        directory = lock_directory(str(tmp_path / "store.db"))
        aside = str(tmp_path / "locks-aside")
        os.rename(directory, aside)
        Path(directory).write_bytes(b"not a directory")
        try:
            assert lock.ensure() is False
            assert lock.ensure() is False  # still undecided, still not raising
        finally:
            os.unlink(directory)
            os.rename(aside, directory)
        # The flock was never let go: the same file is held, and ensure() says so again.
        assert locks.held_session_locks(["engine-a"]) == {"engine-a"}
        assert lock.ensure() is True
        lock.release()
        assert locks.held_session_locks(["engine-a"]) == set()


# -- PostgreSQL -------------------------------------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_postgres_terminated_lock_session_is_seen_and_ensure_retakes_it(storage: Storage) -> None:
    from weft_sync.storage.postgres.locks import PostgresSessionLock

    locks = _locks(storage)
    lock = locks.acquire_session_lock("engine-pg")
    assert isinstance(lock, PostgresSessionLock)
    try:
        backend_pid = lock._slots[0][0].info.backend_pid  # type: ignore[index]
        with storage._connection("test") as conn:  # type: ignore[attr-defined]
            conn.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
        wait_until(
            lambda: not locks.held_session_locks(["engine-pg"]),
            "the lock is not held",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        assert lock.ensure() is True
        assert locks.held_session_locks(["engine-pg"]) == {"engine-pg"}
        assert lock._slots[0] is not None
        assert lock._slots[0][0].info.backend_pid != backend_pid
    finally:
        lock.release()
    assert locks.held_session_locks(["engine-pg"]) == set()


@pytest.mark.postgres_only
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_postgres_locks_of_two_tables_do_not_mix(storage: Storage, storage_url: str) -> None:
    from weft_sync.storage import open_storage

    other_url = storage_url.rsplit("table=", 1)[0] + "table=t_other_" + os.urandom(4).hex()
    with open_storage(other_url) as other:
        lock = _locks(storage).acquire_session_lock("same-name")
        try:
            assert _locks(other).held_session_locks(["same-name"]) == set()
            second = _locks(other).acquire_session_lock("same-name")
            second.release()
        finally:
            lock.release()


@pytest.mark.postgres_only
def test_postgres_server_restart_drops_the_lock_and_ensure_retakes_it(
    private_cluster: PostgresCluster,
) -> None:
    from weft_sync.storage import PostgresStorage

    with PostgresStorage(private_cluster.url, table="weft_locks_restart", timeout=2.0) as store:
        locks = _locks(store)
        lock = locks.acquire_session_lock("engine-r")
        try:
            private_cluster.stop(remove=False)
            assert lock.ensure() is False  # the server is down: bounded, then not held
            private_cluster.start()

            def answers_not_held() -> bool:
                try:
                    return not locks.held_session_locks(["engine-r"])
                except StorageError:  # the pool is still reconnecting
                    return False

            wait_until(answers_not_held, "the server is back", timeout_s=WAIT_S, poll_s=POLL_S)
            assert lock.ensure() is True
            assert locks.held_session_locks(["engine-r"]) == {"engine-r"}
        finally:
            lock.release()
