"""A PostgreSQL database of a test's own, for Django settings that need a whole database."""

from __future__ import annotations

import uuid
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit


class FreshPostgresDatabase:
    """``CREATE DATABASE`` on the server of ``base_url`` on entry; ``DROP`` it on exit.

    Entering returns the ``postgresql://`` URL of the new database (the base URL's credentials
    and query, such as a socket ``host``, kept).
    """

    def __init__(self, base_url: str) -> None:
        self._base = base_url
        self.name = "weft_dj_" + uuid.uuid4().hex[:12]

    def __enter__(self) -> str:
        self._execute(f"CREATE DATABASE {self.name}")
        parts = urlsplit(self._base)
        return urlunsplit((parts.scheme, parts.netloc, "/" + self.name, parts.query, ""))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")

    def _execute(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self._base, autocommit=True) as conn:
            conn.execute(sql)
