"""A statement that runs too long is cut by the session's ``statement_timeout``, for real.

The store is opened with no ``lock_timeout`` at all, so the only bound left on a statement that
waits for a row lock a second session holds is the ``statement_timeout``: the call must come back
with :class:`~weft_sync.errors.StorageError` within that bound, and write nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from weft_sync.errors import StorageError
from weft_sync.storage.postgres.store import PostgresStorage

STATEMENT_TIMEOUT_S = 1.0
GUARD_S = 10.0
"""Far past the bound: a call still blocked by then was not cut by it."""


@pytest.fixture
def table(postgres_base_url: str) -> Iterator[str]:
    name = "t_" + uuid.uuid4().hex[:16]
    yield name
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


def test_a_write_blocked_by_a_row_lock_is_cut_by_the_statement_timeout(
    postgres_base_url: str, table: str
) -> None:
    with PostgresStorage(
        postgres_base_url,
        table=table,
        lock_timeout=None,
        statement_timeout=STATEMENT_TIMEOUT_S,
    ) as store:
        store.put("k", b"v0")
        outcome: list[BaseException | None] = []
        elapsed: list[float] = []

        def blocked_put() -> None:
            start = time.monotonic()
            try:
                store.put("k", b"v1")
                outcome.append(None)
            except BaseException as exc:  # judged by the test thread
                outcome.append(exc)
            elapsed.append(time.monotonic() - start)

        with psycopg.connect(postgres_base_url) as foreign:
            foreign.execute(f'SELECT value FROM "{table}" WHERE key = %s FOR UPDATE', ["k"])
            worker = threading.Thread(target=blocked_put, name="blocked-put", daemon=True)
            worker.start()
            worker.join(GUARD_S)
            still_blocked = worker.is_alive()
            foreign.rollback()  # lets a put the bound did not cut finish, so no thread leaks
        worker.join(GUARD_S)
        assert not worker.is_alive()
        assert not still_blocked, f"the put was still waiting after {GUARD_S} s: no bound cut it"
        (error,) = outcome
        assert isinstance(error, StorageError), error
        assert "statement timeout" in str(error) or "statement timeout" in str(error.__cause__)
        assert STATEMENT_TIMEOUT_S * 0.9 <= elapsed[0] < STATEMENT_TIMEOUT_S + 5.0, elapsed
        assert store.get("k") == b"v0"
