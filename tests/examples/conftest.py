"""Fixtures of the example tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.django_app.databases import FreshPostgresDatabase
from tests.examples.gunicorn_django import Site, migrated_postgres_site, migrated_sqlite_site


@pytest.fixture
def site(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    """A migrated database of the Django example project on the backend under test."""
    if backend == "sqlite":
        yield migrated_sqlite_site(tmp_path / "site.sqlite3")
        return
    base: str = request.getfixturevalue("postgres_base_url")
    with FreshPostgresDatabase(base) as url:
        yield migrated_postgres_site(url)
