"""Fixtures of the command-line tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli import handler


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite store URL (the file does not exist yet), for tests about the entry point."""
    return f"sqlite:///{tmp_path / 'cli.db'}"


@pytest.fixture(autouse=True)
def _fresh_handler_record() -> Iterator[None]:
    handler.take_resumed()
    yield
    handler.take_resumed()
