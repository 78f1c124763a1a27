"""The PostgreSQL backend: :class:`PostgresStorage` (needs the ``postgres`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import PostgresStorage

__all__ = [
    "PostgresStorage",
]


def __getattr__(name: str) -> Any:
    # Its module imports the optional driver, so it is imported on first use.
    if name == "PostgresStorage":
        from .store import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
