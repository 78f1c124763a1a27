"""Probes of published lock identities: FREE only on proof that the holder is gone.

Every fault here is done for real: a holder process SIGKILLed, its lock file or the whole lock
directory removed, another file put at its path, its PostgreSQL lock session terminated, the
server restarted under it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.liveness.crashes import dead_lock, states_seen
from tests.liveness.procs import POLL_S, WAIT_S, holding
from tests.pgcluster import PostgresCluster, as_server_user
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.reclaim.engine_records import decode_engine_record
from weft_sync.storage import PostgresStorage, SqliteStorage, Storage, open_storage
from weft_sync.storage.session_locks import LockState, SupportsSessionLocks, storage_session_locks
from weft_sync.storage.sqlite.locks import lock_directory

HELD, FREE, UNKNOWN = LockState.HELD, LockState.FREE, LockState.UNKNOWN


def _locks(storage: Storage) -> SupportsSessionLocks:
    locks = storage_session_locks(storage)
    assert locks is not None
    return locks


def _published(storage: Storage, engine_id: str) -> str:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None and record.lock_id is not None
    return record.lock_id


def test_a_held_lock_is_held_and_the_lock_a_dead_holder_left_is_free(storage: Storage) -> None:
    locks = _locks(storage)
    lock = locks.acquire_session_lock("alive")
    try:
        dead = dead_lock(storage, "dead")
        states = locks.probe_session_locks({"alive": lock.identity, "dead": dead})
    finally:
        lock.release()
    assert states == {"alive": HELD, "dead": FREE}
    assert locks.probe_session_locks({}) == {}


def test_without_a_matching_identity_nothing_is_proven(storage: Storage) -> None:
    locks = _locks(storage)
    dead = dead_lock(storage, "dead")
    other = dead_lock(storage, "other")
    assert locks.probe_session_locks(
        {
            "dead": None,  # no identity published (a record of an older engine)
            "other": "not an identity",
        }
    ) == {"dead": UNKNOWN, "other": UNKNOWN}
    assert locks.probe_session_locks({"dead": dead}) == {"dead": FREE}
    assert locks.probe_session_locks({"other": other}) == {"other": FREE}


def test_a_sigkilled_holder_leaves_its_lock_provably_free(
    storage: Storage, storage_url: str
) -> None:
    locks = _locks(storage)
    with holding(storage_url, "victim", mode="engine") as victim:
        identity = _published(storage, "victim")
        assert locks.probe_session_locks({"victim": identity}) == {"victim": HELD}
        victim.signal(signal.SIGKILL)
        victim.proc.wait()
        wait_until(
            lambda: locks.probe_session_locks({"victim": identity})["victim"] is FREE,
            "the killed holder's lock is proven free",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )


# -- SQLite -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_a_removed_lock_directory_proves_nothing(storage: Storage, storage_url: str) -> None:
    assert isinstance(storage, SqliteStorage)
    locks = _locks(storage)
    with holding(storage_url, "victim", mode="engine"):
        identity = _published(storage, "victim")
        shutil.rmtree(lock_directory(storage.path))
        assert states_seen(locks, "victim", identity) == {UNKNOWN}
    # Dead now, with its file gone: still nothing proven (its claims go by their expiry).
    assert locks.probe_session_locks({"victim": identity}) == {"victim": UNKNOWN}


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_another_file_at_the_lock_path_proves_nothing(storage: Storage) -> None:
    assert isinstance(storage, SqliteStorage)
    locks = _locks(storage)
    identity = dead_lock(storage, "victim")
    [name] = os.listdir(lock_directory(storage.path))
    path = os.path.join(lock_directory(storage.path), name)
    os.unlink(path)
    # A new, unlocked file at the path (the file system may even give it the freed inode).
    Path(path).write_bytes(b"")
    assert locks.probe_session_locks({"victim": identity}) == {"victim": UNKNOWN}


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_a_store_opened_through_a_symlink_shares_its_locks(
    storage: Storage, tmp_path: Path
) -> None:
    assert isinstance(storage, SqliteStorage)
    link = tmp_path / "elsewhere" / "link.db"
    link.parent.mkdir()
    link.symlink_to(storage.path)
    assert lock_directory(str(link)) == lock_directory(storage.path)
    with SqliteStorage(str(link), table=storage.table) as through_link:
        lock = _locks(through_link).acquire_session_lock("linked")
        try:
            assert _locks(storage).probe_session_locks({"linked": lock.identity}) == {
                "linked": HELD
            }
        finally:
            lock.release()


# -- PostgreSQL -------------------------------------------------------------------------------


def _terminate(url: str, pid: int) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.postgres_only
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_postgres_a_terminated_lock_session_proves_nothing(
    storage: Storage, storage_url: str, postgres_base_url: str
) -> None:
    locks = _locks(storage)
    with holding(storage_url, "victim", mode="engine"):
        identity = _published(storage, "victim")
        lock_pid = int(identity.split(":")[0])
        _terminate(postgres_base_url, lock_pid)
        wait_until(
            lambda: not locks.held_session_locks(["victim"]),
            "the lock session is gone",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        # Its witness session lives on: the holder lives, and will take its lock again.
        assert states_seen(locks, "victim", identity) == {UNKNOWN}


def _immediate_restart(cluster: PostgresCluster) -> None:
    stop = [cluster.pg_ctl, "-D", str(cluster.data_dir), "-m", "immediate", "-w", "stop"]
    subprocess.run(as_server_user(stop), capture_output=True, check=True)
    cluster.start()


@pytest.mark.postgres_only
@pytest.mark.slow
def test_postgres_a_lock_taken_before_a_restart_is_never_proven_free(
    private_cluster: PostgresCluster,
) -> None:
    url = f"{private_cluster.url}&table=weft_restart_proof"
    open_storage(url).close()  # creates the table
    with holding(url, "victim", mode="engine") as victim:
        with PostgresStorage(private_cluster.url, table="weft_restart_proof") as judge:
            identity = _published(judge, "victim")
            assert _locks(judge).probe_session_locks({"victim": identity}) == {"victim": HELD}
        _immediate_restart(private_cluster)
        with PostgresStorage(private_cluster.url, table="weft_restart_proof") as judge:
            locks = _locks(judge)
            assert locks.probe_session_locks({"victim": identity}) == {"victim": UNKNOWN}
            victim.signal(signal.SIGKILL)
            victim.proc.wait()
            # Dead now, but its lock was taken before the server's last start: no proof.
            assert states_seen(locks, "victim", identity) == {UNKNOWN}
