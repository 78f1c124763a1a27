"""Ordinary operations that make session locks look absent move no live claim.

Three engines, each in its own process, hold ten workflows each with a 30 s TTL: no claim can
expire during a test, so any claim that changes hands was taken from a live engine on a wrong
crash verdict. Each fault is done for real, while the engines run their watchers and passes:
the lock directory removed (a tmp cleaner), one engine's lock file removed, the store opened
through a symlink, PostgreSQL's ``idle_session_timeout`` set on the database, one engine's lock
session terminated, the server stopped with ``-m immediate`` and started again, and a tmpfs
mounted over the lock directory in one engine's own mount namespace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from tests.integration.fleet_worker import FleetEngine, run_engine
from tests.integration.procs import (
    holders,
    journal_errors,
    read_journal,
    spawn,
    stop_all,
    wait_ready,
)
from tests.pgcluster import PostgresCluster, as_server_user
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.reclaim.engine_records import decode_engine_record
from weft_sync.storage import Storage, open_storage
from weft_sync.storage.session_locks import LockState, storage_session_locks
from weft_sync.storage.sqlite.locks import lock_directory

ENGINES = 3
PER_ENGINE = 10
TTL_MS = 30_000
RENEW_MS = 1_000
OBSERVE_S = 4.0
"""How long the engines run after a fault: dozens of watcher probes and several passes."""
START_S = 60.0
POLL_S = 0.05

pytestmark = pytest.mark.slow


class Fleet:
    """The running engines, their ids and the claims they started with."""

    def __init__(self, tmp_path: Path, urls: list[str]) -> None:
        self.tmp_path = tmp_path
        self.processes: list[BaseProcess] = []
        self.configs: list[FleetEngine] = []
        for index, url in enumerate(urls):
            config = FleetEngine(
                name=f"engine-{index}",
                url=url,
                journal=str(tmp_path / f"engine-{index}.jsonl"),
                log=str(tmp_path / f"engine-{index}.log"),
                go=str(tmp_path / "go"),
                stop=str(tmp_path / "stop"),
                workflows=[f"wf-{index}-{n:02d}" for n in range(PER_ENGINE)],
                claim_ttl_ms=TTL_MS,
                renew_ms=RENEW_MS,
            )
            self.configs.append(config)
            self.processes.append(spawn(run_engine, config, config.name))
        deadline = time.monotonic() + START_S
        self.engine_ids: list[str] = []
        for config, process in zip(self.configs, self.processes, strict=True):

            def alive(config: FleetEngine = config, process: BaseProcess = process) -> None:
                assert process.is_alive(), (config.name, journal_errors(config.journal))

            wait_ready(config.name, config.journal, deadline, POLL_S, alive)
            ready = [e for e in read_journal(config.journal) if e["ev"] == "ready"]
            self.engine_ids.append(str(ready[0]["engine"]))

    def stop(self) -> None:
        stop_all(self.processes, self.tmp_path / "stop")
        for config in self.configs:
            assert journal_errors(config.journal) == [], config.name


@contextmanager
def fleet(tmp_path: Path, urls: list[str]) -> Iterator[Fleet]:
    running = Fleet(tmp_path, urls)
    try:
        yield running
    finally:
        running.stop()


def _held_by_starters(storage: Storage, running: Fleet) -> dict[str, tuple[str, int]]:
    return {
        wid: (engine, 1)
        for engine, config in zip(running.engine_ids, running.configs, strict=True)
        for wid in config.workflows
    }


def _takeovers(storage: Storage, expected: dict[str, tuple[str, int]]) -> list[str]:
    now = holders(storage)
    return sorted(wid for wid, owner in expected.items() if now.get(wid) != owner)


def _observe(
    storage: Storage, running: Fleet, fault: Callable[[], None], repeat: int = 1
) -> list[str]:
    """Apply ``fault`` ``repeat`` times while the engines run; return the claims that moved."""
    expected = _held_by_starters(storage, running)
    assert holders(storage) == expected
    for _ in range(repeat):
        fault()
        time.sleep(OBSERVE_S / repeat)  # the engines run meanwhile; nothing waits for expiry
    return _takeovers(storage, expected)


def _lock_id(storage: Storage, engine_id: str) -> str | None:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None
    return record.lock_id


def _republished_and_held(storage: Storage, engine_id: str, before: str | None) -> None:
    """The engine took its lock again and published the new lock object, which probes held."""
    locks = storage_session_locks(storage)
    assert locks is not None

    def republished_and_held() -> bool:
        now = _lock_id(storage, engine_id)
        held = now is not None and locks.probe_session_locks({engine_id: now})[engine_id]
        return now != before and held is LockState.HELD

    wait_until(
        republished_and_held,
        f"{engine_id} to republish a held lock",
        timeout_s=START_S,
        poll_s=POLL_S,
    )


# -- SQLite -----------------------------------------------------------------------------------


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "store.db"
    open_storage(f"sqlite:///{path}").close()
    return path


def test_sqlite_removing_the_lock_directory_moves_no_live_claim(
    tmp_path: Path, db_path: Path
) -> None:
    url = f"sqlite:///{db_path}"
    with fleet(tmp_path, [url] * ENGINES) as running, open_storage(url) as storage:
        before = _lock_id(storage, running.engine_ids[0])

        def clean_tmp() -> None:
            shutil.rmtree(lock_directory(str(db_path)), ignore_errors=True)

        assert _observe(storage, running, clean_tmp, repeat=5) == []
        # Every engine is back on a lock of its own, published and held.
        _republished_and_held(storage, running.engine_ids[0], before)


def test_sqlite_removing_one_engines_lock_file_moves_none_of_its_claims(
    tmp_path: Path, db_path: Path
) -> None:
    url = f"sqlite:///{db_path}"
    with fleet(tmp_path, [url] * ENGINES) as running, open_storage(url) as storage:
        victim = running.engine_ids[1]
        path = os.path.join(lock_directory(str(db_path)), quote(victim, safe="") + ".lock")
        before = _lock_id(storage, victim)

        def remove_file() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

        assert _observe(storage, running, remove_file, repeat=5) == []
        _republished_and_held(storage, victim, before)


def test_sqlite_an_engine_on_a_symlinked_path_shares_the_store(
    tmp_path: Path, db_path: Path
) -> None:
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "alias.db").symlink_to(db_path)
    urls = [f"sqlite:///{db_path}"] * (ENGINES - 1) + [f"sqlite:///{link_dir / 'alias.db'}"]
    with fleet(tmp_path, urls) as running, open_storage(urls[0]) as storage:
        assert _observe(storage, running, lambda: None) == []
        locks = storage_session_locks(storage)
        assert locks is not None
        published = {e: _lock_id(storage, e) for e in running.engine_ids}
        assert locks.probe_session_locks(published) == dict.fromkeys(
            running.engine_ids, LockState.HELD
        )


# -- PostgreSQL -------------------------------------------------------------------------------


def _admin(url: str, statement: str, params: list[object] | None = None) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(statement, params)


@pytest.mark.postgres_only
def test_postgres_idle_session_timeout_on_the_database_moves_no_live_claim(
    tmp_path: Path, private_cluster: PostgresCluster
) -> None:
    url = f"{private_cluster.url}&table=weft_idle"
    _admin(private_cluster.url, "ALTER DATABASE postgres SET idle_session_timeout = '3s'")
    with fleet(tmp_path, [url] * ENGINES) as running, open_storage(url) as storage:
        # Past the 3 s twice over: every idle session the server could end has been idle.
        assert _observe(storage, running, lambda: time.sleep(3.0)) == []
        locks = storage_session_locks(storage)
        assert locks is not None
        published = {e: _lock_id(storage, e) for e in running.engine_ids}
        assert locks.probe_session_locks(published) == dict.fromkeys(
            running.engine_ids, LockState.HELD
        )


@pytest.mark.postgres_only
def test_postgres_terminating_an_engines_lock_session_moves_none_of_its_claims(
    tmp_path: Path, private_cluster: PostgresCluster
) -> None:
    url = f"{private_cluster.url}&table=weft_terminate"
    with fleet(tmp_path, [url] * ENGINES) as running, open_storage(url) as storage:
        victim = running.engine_ids[1]
        before = _lock_id(storage, victim)
        assert before is not None

        def terminate() -> None:
            lock_pid = int(before.split(":")[0])
            _admin(private_cluster.url, "SELECT pg_terminate_backend(%s)", [lock_pid])

        assert _observe(storage, running, terminate) == []
        _republished_and_held(storage, victim, before)


@pytest.mark.postgres_only
def test_postgres_a_restart_under_three_engines_moves_no_live_claim(
    tmp_path: Path, private_cluster: PostgresCluster
) -> None:
    url = f"{private_cluster.url}&table=weft_restart3"
    with fleet(tmp_path, [url] * ENGINES) as running:
        with open_storage(url) as storage:
            expected = _held_by_starters(storage, running)
            assert holders(storage) == expected
            before = {e: _lock_id(storage, e) for e in running.engine_ids}
        # The test cluster runs with synchronous_commit=off: an immediate stop would lose the
        # last commits (the latest starts among them). Flushed first, as a durable server is.
        _admin(private_cluster.url, "CHECKPOINT")
        stop = [private_cluster.pg_ctl, "-D", str(private_cluster.data_dir)]
        subprocess.run(
            as_server_user([*stop, "-m", "immediate", "-w", "stop"]),
            capture_output=True,
            check=True,
        )
        time.sleep(1.0)  # the outage the engines ride out
        private_cluster.start()
        time.sleep(OBSERVE_S)
        with open_storage(url) as storage:
            assert _takeovers(storage, expected) == []
            for engine in running.engine_ids:
                _republished_and_held(storage, engine, before[engine])


_NS_ENGINE = (
    "import json, sys\n"
    "from tests.integration.fleet_worker import FleetEngine, run_engine\n"
    "run_engine(FleetEngine(**json.loads(sys.argv[1])))\n"
)


def test_sqlite_a_tmpfs_over_the_lock_directory_in_another_mount_namespace_moves_nothing(
    tmp_path: Path, db_path: Path
) -> None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare or mount is not installed")
    url = f"sqlite:///{db_path}"
    main_dir = tmp_path / "main"
    main_dir.mkdir()
    with fleet(main_dir, [url] * (ENGINES - 1)) as running, open_storage(url) as storage:
        config = FleetEngine(
            name="engine-ns",
            url=url,
            journal=str(tmp_path / "engine-ns.jsonl"),
            log=str(tmp_path / "engine-ns.log"),
            go=str(main_dir / "go"),
            stop=str(main_dir / "stop"),
            workflows=[f"wf-ns-{n:02d}" for n in range(PER_ENGINE)],
            claim_ttl_ms=TTL_MS,
            renew_ms=RENEW_MS,
        )
        locks_dir = lock_directory(str(db_path))
        # Its own lock directory is an empty tmpfs nobody else sees: the locks of the others
        # are missing for it, and its lock is missing for them.
        command = (
            f"mount -t tmpfs tmpfs {locks_dir} && "
            f"exec {sys.executable} -c '{_NS_ENGINE}' '{json.dumps(dataclasses.asdict(config))}'"
        )
        proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", command],
            cwd=str(Path(__file__).resolve().parents[2]),
            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + START_S
            while not any(e["ev"] == "ready" for e in _journal(config.journal)):
                if proc.poll() is not None:
                    error = proc.stderr.read() if proc.stderr else ""
                    if "mount" in error and "permission" in error.lower():
                        pytest.skip(f"this machine does not allow the mount: {error[:200]}")
                    raise AssertionError(f"the namespaced engine ended: {error}")
                assert time.monotonic() < deadline, "the namespaced engine never became ready"
                time.sleep(POLL_S)
            ns_engine = str(
                next(e for e in _journal(config.journal) if e["ev"] == "ready")["engine"]
            )
            expected = _held_by_starters(storage, running)
            expected.update({wid: (ns_engine, 1) for wid in config.workflows})
            assert holders(storage) == expected
            time.sleep(OBSERVE_S)  # everyone probes everyone, every 50 ms, meanwhile
            assert _takeovers(storage, expected) == []
        finally:
            (main_dir / "stop").touch()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)
            if proc.stderr is not None:
                proc.stderr.close()
        assert journal_errors(config.journal) == []


def _journal(path: str) -> list[dict[str, object]]:
    return read_journal(path) if os.path.exists(path) else []
