"""Fixtures shared by the integration tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def thread_crashes() -> Iterator[list[threading.ExceptHookArgs]]:
    """Every exception that ends a thread during the test (instead of printing it)."""
    crashes: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = crashes.append
    try:
        yield crashes
    finally:
        threading.excepthook = previous
