"""The SQLite backend: :class:`SqliteStorage` and its writer, readers and locks."""

from __future__ import annotations

from .store import SqliteStorage

__all__ = [
    "SqliteStorage",
]
