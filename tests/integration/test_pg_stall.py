"""A stalled PostgreSQL backend blocks no call past the renew interval + 1 s.

The store's server backends (found in ``pg_stat_activity`` by the store's ``application_name``)
are frozen with SIGSTOP: the server then enforces no ``statement_timeout`` at all, so only the
client-side deadline (a cancel, then the socket cut) can end the call. SIGCONT afterwards.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from weft_sync.errors import StorageError
from weft_sync.storage.postgres.store import PostgresStorage

RENEW_MS = 2_000
BOUND_S = RENEW_MS / 1000 + 1.0

pytestmark = [pytest.mark.postgres_only, pytest.mark.slow]


def _backends(url: str, application_name: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"{application_name} %"],
        ).fetchall()
    return [int(pid) for (pid,) in rows]


@contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _timed(call: object) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        call()  # type: ignore[operator]
    except StorageError as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


def test_a_stopped_backend_blocks_no_call_past_the_renew_interval_plus_one_second(
    postgres_base_url: str,
) -> None:
    app = f"weft-stall-{uuid.uuid4().hex[:8]}"
    sep = "&" if "?" in postgres_base_url else "?"
    url = f"{postgres_base_url}{sep}application_name={app}"
    table = "t_" + uuid.uuid4().hex[:16]
    with PostgresStorage(url, table=table, renew_interval_ms=RENEW_MS) as store:
        store.put("k", b"v")
        pids = _backends(postgres_base_url, app)
        assert pids, "the store has no server session to stop"
        with _stopped(pids):
            read_s, read_error = _timed(lambda: store.get("k"))
            write_s, write_error = _timed(lambda: store.put("k", b"w"))
        assert read_s <= BOUND_S, f"a read blocked {read_s:.2f} s"
        assert write_s <= BOUND_S, f"a write blocked {write_s:.2f} s"
        # The read was cut (its only connection was frozen); the write ran on a fresh one or was
        # cut too. Either way the store works again once the backends run.
        assert isinstance(read_error, StorageError)
        assert write_error is None or isinstance(write_error, StorageError)
        assert store.get("k") in (b"v", b"w")
        store.put("k", b"x")
        assert store.get("k") == b"x"
