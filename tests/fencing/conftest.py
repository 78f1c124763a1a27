"""Fixtures of the fence tests: a store and a host table in one database, per driver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fencing.hosts import CASES, HostEnv, make_env


@pytest.fixture(params=CASES, ids=[f"{b}-{d}" for b, d in CASES])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HostEnv]:
    """A store and a host table in the same database, reached through one driver."""
    backend, driver = request.param
    base = request.getfixturevalue("postgres_base_url") if backend == "postgres" else None
    host = make_env(backend, driver, tmp_path, base)
    try:
        yield host
    finally:
        host.close()


@pytest.fixture(params=("sqlite", "postgres"))
def raw_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HostEnv]:
    """The same, through the plain driver of each backend (sqlite3, psycopg)."""
    backend = request.param
    base = request.getfixturevalue("postgres_base_url") if backend == "postgres" else None
    host = make_env(backend, "sqlite3" if backend == "sqlite" else "psycopg", tmp_path, base)
    try:
        yield host
    finally:
        host.close()


@pytest.fixture
def sqlite3_env(tmp_path: Path) -> Iterator[HostEnv]:
    """A SQLite store and host table, reached through ``sqlite3``."""
    host = make_env("sqlite", "sqlite3", tmp_path, None)
    try:
        yield host
    finally:
        host.close()
