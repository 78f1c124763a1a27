"""The psycopg 3 adapter for a driver connection a framework wraps (SQLAlchemy, Django).

Separate from :mod:`weft_sync.fencing.adapters` because the framework adapters, which that
module dispatches to, need it: psycopg is imported only if the host already loaded it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .psycopg import PsycopgTransaction


def as_psycopg(connection: object) -> PsycopgTransaction | None:
    """The psycopg 3 adapter over ``connection`` when it is a psycopg 3 connection (a driver
    connection a framework wraps), else ``None``; psycopg is imported only if already loaded."""
    if "psycopg" not in sys.modules:
        return None
    import psycopg

    if not isinstance(connection, psycopg.Connection):
        return None
    from .psycopg import PsycopgTransaction

    return PsycopgTransaction(connection)
