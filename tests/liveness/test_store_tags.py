"""PostgreSQL: a lock is proven free only when no session of its holder's store is left.

Every session a store instance opens carries its random tag in ``application_name``, and the
lock's identity publishes the tag. Terminating a live engine's lock and witness sessions (an
idle-session killer, a DBA's cleanup) leaves its pooled sessions, so nothing is proven: its
claims stay until they expire, and its next heartbeat takes the lock again. A killed engine's
sessions all end, and its claims move at once as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from tests.liveness.crashes import states_seen
from tests.liveness.procs import POLL_S, ROOT, WAIT_S
from tests.maintenance.discovery_helpers import JOB, Driven, holders
from tests.maintenance.helpers import write_workflow
from tests.support.waiting import wait_until
from weft_sync import Ownership, OwnershipOptions, WorkflowClaimUnavailableError, keys
from weft_sync.reclaim.engine_records import decode_engine_record
from weft_sync.storage import PostgresStorage, Storage, open_storage
from weft_sync.storage.postgres.locks import (
    SessionIdentity,
    parse_session_identity,
    session_identity,
    tagged_application_name,
)
from weft_sync.storage.session_locks import LockState, SupportsSessionLocks, storage_session_locks

pytestmark = [
    pytest.mark.postgres_only,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]

HELD, FREE, UNKNOWN = LockState.HELD, LockState.FREE, LockState.UNKNOWN
TAG = "0123456789abcdef"
# The survivor's first maintenance tick comes after one renew interval: far beyond the test.
OPTIONS = OwnershipOptions(claim_ttl="900s", claim_renew_interval="300s")


def _locks(storage: Storage) -> SupportsSessionLocks:
    locks = storage_session_locks(storage)
    assert locks is not None
    return locks


def _parsed(identity: str) -> SessionIdentity:
    parsed = parse_session_identity(identity)
    assert parsed is not None and parsed.tag is not None, identity
    return parsed


def _published(storage: Storage, engine_id: str) -> str | None:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None
    return record.lock_id


def _terminate_lock_sessions(url: str, identity: str) -> None:
    """End the lock and witness backends ``identity`` names; wait until both are gone."""
    proof = _parsed(identity)
    pids = [proof.lock_pid, proof.witness_pid]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int4[]) AS pid", [pids])
        wait_until(
            lambda: (
                not admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s::int4[])", [pids]
                ).fetchall()
            ),
            "both lock sessions to end",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )


def _application_names(url: str, tag: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT application_name FROM pg_stat_activity WHERE strpos(application_name, %s) > 0",
            [tag],
        ).fetchall()
    return [str(row[0]) for row in rows]


@contextmanager
def _engine(url: str, engine_id: str, workflow_ids: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A real engine in a child process holding ``workflow_ids``; SIGKILLed and reaped on exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.liveness.claiming_engine", url, engine_id, *workflow_ids],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.kill()
            _, err = proc.communicate(timeout=WAIT_S)
            raise AssertionError(f"the engine did not start: {line!r}\n{err}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


# -- the probe --------------------------------------------------------------------------------


def test_terminated_lock_sessions_of_a_connected_store_prove_nothing(
    storage: Storage, storage_url: str, postgres_base_url: str
) -> None:
    locks = _locks(storage)
    with open_storage(storage_url) as victim:
        victim.put("k", b"v")  # its pool is connected
        lock = _locks(victim).acquire_session_lock("victim")
        try:
            identity = lock.identity
            assert locks.probe_session_locks({"victim": identity}) == {"victim": HELD}
            _terminate_lock_sessions(postgres_base_url, identity)
            assert locks.held_session_locks(["victim"]) == set()
            assert states_seen(locks, "victim", identity) == {UNKNOWN}
            # The holder takes its lock again, on new sessions, and is seen holding it.
            assert lock.ensure() is True
            assert lock.identity != identity
            assert locks.probe_session_locks({"victim": lock.identity}) == {"victim": HELD}
            identity = lock.identity
        finally:
            lock.release()
        # Let go, but its store is still connected: nothing proves the holder gone.
        assert locks.probe_session_locks({"victim": identity}) == {"victim": UNKNOWN}
    # The store closed: every session of it has ended, and its lock is proven free.
    wait_until(
        lambda: locks.probe_session_locks({"victim": identity})["victim"] is FREE,
        "the closed store's sessions to end",
        timeout_s=WAIT_S,
        poll_s=POLL_S,
    )


def test_a_three_field_identity_is_judged_on_its_two_sessions_alone(
    storage: Storage, storage_url: str, postgres_base_url: str
) -> None:
    locks = _locks(storage)
    with open_storage(storage_url) as victim:
        victim.put("k", b"v")
        lock = _locks(victim).acquire_session_lock("older")
        try:
            identity = lock.identity
            proof = _parsed(identity)
            older = session_identity(proof.lock_pid, proof.witness_pid, proof.started_us)
            assert parse_session_identity(older) == SessionIdentity(
                proof.lock_pid, proof.witness_pid, proof.started_us, None
            )
            assert locks.probe_session_locks({"older": older}) == {"older": HELD}
            _terminate_lock_sessions(postgres_base_url, identity)
            # As an engine without a tag published it: both sessions gone is proof enough.
            assert locks.probe_session_locks({"older": older}) == {"older": FREE}
            assert locks.probe_session_locks({"older": identity}) == {"older": UNKNOWN}
        finally:
            lock.release()


@pytest.mark.parametrize(
    "identity",
    ["1:2:3:", "1:2:3:XYZ", "1:2:3:0123456789ABCDEF", "1:2:3:0123456789abcdef:x", "1:2:\u00b2"],
)
def test_a_malformed_identity_proves_nothing(storage: Storage, identity: str) -> None:
    assert parse_session_identity(identity) is None
    assert _locks(storage).probe_session_locks({"gone": identity}) == {"gone": UNKNOWN}


# -- application_name -----------------------------------------------------------------------


def test_every_session_of_a_store_carries_its_tag(storage_url: str, postgres_base_url: str) -> None:
    with open_storage(f"{storage_url}&application_name=billing%20worker&min_size=2") as store:
        lock = _locks(store).acquire_session_lock("tagged")
        try:
            tag = _parsed(lock.identity).tag
            assert tag is not None
            # Two pooled sessions, the lock's and the witness's: the DSN's name, then the tag.
            wait_until(
                lambda: len(_application_names(postgres_base_url, tag)) == 4,
                "the pool's second session",
                timeout_s=WAIT_S,
                poll_s=POLL_S,
            )
            assert _application_names(postgres_base_url, tag) == [f"billing worker {tag}"] * 4
        finally:
            lock.release()


def test_a_store_without_a_name_of_its_own_is_named_weft_sync(
    storage_url: str, postgres_base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    with open_storage(storage_url) as store:
        assert isinstance(store, PostgresStorage)
        lock = _locks(store).acquire_session_lock("plain")
        try:
            tag = _parsed(lock.identity).tag
            assert tag is not None
            assert set(_application_names(postgres_base_url, tag)) == {f"weft_sync {tag}"}
        finally:
            lock.release()
    monkeypatch.setenv("PGAPPNAME", "from-env")
    with open_storage(storage_url) as store:
        lock = _locks(store).acquire_session_lock("plain")
        try:
            tag = _parsed(lock.identity).tag
            assert tag is not None
            assert set(_application_names(postgres_base_url, tag)) == {f"from-env {tag}"}
        finally:
            lock.release()


def test_a_long_or_non_ascii_name_is_cut_so_that_the_tag_fits(
    storage_url: str, postgres_base_url: str
) -> None:
    assert tagged_application_name("x" * 80, TAG) == "x" * 46 + " " + TAG
    assert len(tagged_application_name("x" * 80, TAG).encode()) == 63
    assert tagged_application_name("caf\u00e9\n", TAG) == f"caf?? {TAG}"
    assert tagged_application_name("", TAG) == f"weft_sync {TAG}"
    assert tagged_application_name(None, TAG) == f"weft_sync {TAG}"
    with open_storage(f"{storage_url}&application_name=caf%C3%A9{'y' * 70}") as store:
        lock = _locks(store).acquire_session_lock("long")
        try:
            tag = _parsed(lock.identity).tag
            assert tag is not None
            assert set(_application_names(postgres_base_url, tag)) == {
                tagged_application_name("caf\u00e9" + "y" * 70, tag)
            }
        finally:
            lock.release()


# -- end to end -------------------------------------------------------------------------------


def test_a_live_engine_whose_lock_sessions_end_keeps_its_claims_until_killed(
    storage: Storage, storage_url: str, postgres_base_url: str
) -> None:
    ids = ["tagged-0", "tagged-1"]
    for wid in ids:
        write_workflow(storage, wid, wf_type=JOB)
    locks = _locks(storage)
    driven = Driven()
    with (
        _engine(storage_url, "engine-t", [*ids, "bare"]) as child,
        Ownership.open(
            storage, engine_id="engine-s", options=OPTIONS, handlers={JOB: driven}
        ) as survivor,
    ):
        identity = _published(storage, "engine-t")
        assert identity is not None
        _terminate_lock_sessions(postgres_base_url, identity)
        assert FREE not in states_seen(locks, "engine-t", identity)
        with pytest.raises(WorkflowClaimUnavailableError), survivor.claim("bare"):
            pass
        survivor.run_maintenance()
        assert holders(storage, [*ids, "bare"]) == dict.fromkeys([*ids, "bare"], ("engine-t", 1))
        assert driven.all_ids() == []
        assert storage.get(keys.engine_liveness("engine-t")) is not None

        # Its next heartbeat takes the lock again and publishes the new sessions.
        def retaken() -> bool:
            now = _published(storage, "engine-t")
            return now not in (None, identity) and locks.probe_session_locks({"engine-t": now}) == {
                "engine-t": HELD
            }

        wait_until(retaken, "the engine's lock taken again", timeout_s=WAIT_S, poll_s=POLL_S)
        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-t", 1))

        # Killed for real: every session of its store ends, and its claims move at once.
        identity = _published(storage, "engine-t")
        assert identity is not None
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        wait_until(
            lambda: locks.probe_session_locks({"engine-t": identity})["engine-t"] is FREE,
            "the killed engine's lock is proven free",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        wait_until(
            lambda: driven.all_ids() == ids,
            "the survivor drove every claim",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        with survivor.claim("bare", wait=WAIT_S) as taken:
            assert taken.epoch == 2
