"""Shared fixtures: real SQLite and real PostgreSQL stores, thread and SQLite storage leak checks.

PostgreSQL comes from ``WEFT_SYNC_TEST_POSTGRES_DSN`` (a ``postgresql://`` URL) or from a throwaway
cluster started here (initdb + pg_ctl on a Unix socket in a temporary directory; through
``runuser -u postgres`` when running as root).

Both backends are expected unless a developer asks for fewer with ``--backends=sqlite`` (or
``WEFT_SYNC_TEST_BACKENDS=sqlite``): the PostgreSQL tests are then deselected and the summary says
so. A PostgreSQL that was expected but cannot be started fails every test that needs it, never a
skip. Under a truthy ``CI`` both backends are required and the switch is refused.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.pgcluster import PostgresCluster, start_cluster
from weft_sync.storage import Storage, open_storage
from weft_sync.storage.sqlite import fork as sqlite_fork

BACKENDS = ("sqlite", "postgres")


BACKENDS_ENV = "WEFT_SYNC_TEST_BACKENDS"
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})
_PG_FIXTURES = frozenset({"postgres_base_url", "private_cluster"})
# What the run did with the PostgreSQL half, for the terminal summary.
_pg_report: dict[str, object] = {"deselected": 0, "error": None}


def in_ci() -> bool:
    """Whether ``$CI`` is set to anything truthy (``true``, ``1``, ``yes``, …)."""
    return os.environ.get("CI", "").strip().lower() not in _FALSE_WORDS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default=None,
        help=(
            "comma-separated storage backends to test: sqlite,postgres (default both; also "
            f"${BACKENDS_ENV}); refused under CI, where both are required"
        ),
    )


def selected_backends(config: pytest.Config) -> tuple[str, ...]:
    """The backends this run tests, from ``--backends`` or ``$WEFT_SYNC_TEST_BACKENDS``."""
    raw = config.getoption("--backends") or os.environ.get(BACKENDS_ENV) or ",".join(BACKENDS)
    chosen = tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    unknown = [name for name in chosen if name not in BACKENDS]
    if unknown or not chosen:
        raise pytest.UsageError(
            f"--backends / ${BACKENDS_ENV}={raw!r}: use a comma-separated subset of "
            f"{', '.join(BACKENDS)}"
        )
    if in_ci() and set(chosen) != set(BACKENDS):
        raise pytest.UsageError(
            f"--backends / ${BACKENDS_ENV}={raw!r} under CI={os.environ.get('CI')!r}: CI runs "
            "both backends"
        )
    return chosen


def _needs_postgres(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "postgres":
        return True
    if item.get_closest_marker("postgres_only") is not None:
        return True
    return bool(_PG_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "postgres" in selected_backends(config):
        return
    dropped = [item for item in items if _needs_postgres(item)]
    if dropped:
        kept = [item for item in items if not _needs_postgres(item)]
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    _pg_report["deselected"] = len(dropped)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the summary
        error = _pg_report["error"]
        workeroutput["pg_report"] = {
            "deselected": _pg_report["deselected"],
            "error": None if error is None else str(error),
        }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """Under xdist, take the PostgreSQL half's report of a worker that finished."""
    report = (getattr(node, "workeroutput", None) or {}).get("pg_report")
    if report:
        _pg_report["deselected"] = max(int(_pg_report["deselected"]), report["deselected"])
        if report["error"] is not None:
            _pg_report["error"] = report["error"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    deselected, error = _pg_report["deselected"], _pg_report["error"]
    if deselected:
        terminalreporter.write_sep(
            "!", f"PostgreSQL half NOT RUN: {deselected} tests deselected by --backends", red=True
        )
    elif error is not None:
        terminalreporter.write_sep(
            "!", f"PostgreSQL half FAILED: the server could not be started: {error}", red=True
        )


def _start_cluster_or_fail() -> PostgresCluster:
    try:
        return start_cluster()
    except Exception as exc:  # pragma: no cover - depends on the machine
        _pg_report["error"] = exc
        pytest.fail(
            f"PostgreSQL could not be started: {exc}. Install the PostgreSQL server, point "
            f"WEFT_SYNC_TEST_POSTGRES_DSN at one, or run the SQLite half only with "
            f"--backends=sqlite (outside CI)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def postgres_base_url() -> Iterator[str]:
    """A ``postgresql://`` URL of a server for the whole session."""
    env = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
    if env:
        yield env
        return
    cluster = _start_cluster_or_fail()
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def private_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of the test's own, which it may stop and restart."""
    cluster = _start_cluster_or_fail()
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


@pytest.fixture(autouse=True)
def _no_leaked_sqlite_storages() -> Iterator[None]:
    """Fail a test that leaves a ``SqliteStorage`` open (or one whose writer did not stop).

    Every fork of the process waits for the reads and writes of each live instance, so one left
    behind by a test would be waited for by the fork tests that run after it.
    """
    before = set(sqlite_fork.live())
    yield
    leaked = [s for s in sqlite_fork.live() if s not in before]
    if leaked:
        del leaked
        gc.collect()  # garbage not yet collected leaves the set; only reachable ones count
        leaked = [s for s in sqlite_fork.live() if s not in before]
    assert not leaked, f"test left SQLite storages open: {leaked}"
