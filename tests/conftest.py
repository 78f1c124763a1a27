"""Shared fixtures: real SQLite and real PostgreSQL stores, and a thread-leak check.

PostgreSQL comes from ``WEFT_SYNC_TEST_POSTGRES_DSN`` (a ``postgresql://`` URL) or from a throwaway
cluster started here (initdb + pg_ctl on a Unix socket in a temporary directory; through
``runuser -u postgres`` when running as root). Under ``CI=true`` a PostgreSQL that cannot be started
fails the run instead of skipping.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.pgcluster import PostgresCluster, start_cluster
from weft_sync.storage import Storage, open_storage

BACKENDS = ("sqlite", "postgres")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _start_cluster_or_skip() -> PostgresCluster:
    try:
        return start_cluster()
    except Exception as exc:  # pragma: no cover - depends on the machine
        if _in_ci():
            pytest.fail(f"PostgreSQL could not be started under CI=true: {exc}")
        pytest.skip(f"PostgreSQL is not available here: {exc}")


@pytest.fixture(scope="session")
def postgres_base_url() -> Iterator[str]:
    """A ``postgresql://`` URL of a server for the whole session."""
    env = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
    if env:
        yield env
        return
    cluster = _start_cluster_or_skip()
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def private_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of the test's own, which it may stop and restart."""
    cluster = _start_cluster_or_skip()
    try:
        yield cluster
    finally:
        cluster.stop()


def _with_table(url: str, table: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}table={table}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test: ``"sqlite"`` or ``"postgres"``."""
    return str(request.param)


@pytest.fixture
def storage_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL naming a fresh, empty store of the backend under test (its own file or table)."""
    table = "t_" + uuid.uuid4().hex[:16]
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}?table={table}"
    base: str = request.getfixturevalue("postgres_base_url")
    return _with_table(base, table)


@pytest.fixture
def open_store(storage_url: str) -> Iterator[Callable[[], Storage]]:
    """Open another instance on the same store; every instance is closed after the test."""
    opened: list[Storage] = []

    def _open() -> Storage:
        store = open_storage(storage_url)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def storage(open_store: Callable[[], Storage]) -> Storage:
    """A fresh store on the backend under test."""
    return open_store()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread running that it started."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        leaked[0].join(timeout=0.05)
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"
