"""An older copy of the store restored in place under running engines (both backends).

Engine A holds workflow X at epoch 2. An older copy of the store (X at epoch 1, unclaimed) is
restored over the live one: on SQLite by writing the backup's bytes into the live file (same
inode, same store id, so no identity check fires), on PostgreSQL by replacing the table's rows
with a copy taken earlier (``DELETE`` + ``INSERT … SELECT``), both while A's store stays open.
Engine C then claims X and mints epoch number 2 a second time. The number repeats; the token
does not: every write of A — the ledger's ``save_checkpoint`` and a fenced write of A's own
host table — is refused, and A loses its claims locally with cause ``store_rollback``.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_epoch
from weft_sync.errors import EngineDeposedError, WorkflowClaimLostWarning
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import open_storage

pytestmark = pytest.mark.timeout(120)

X = "X"
OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)


@dataclass
class Site:
    """One store plus the means to back it up, restore it in place and write a host table."""

    url: str
    backup: Callable[[], None]
    restore: Callable[[], None]
    host_connect: Callable[[], Any]
    host_insert: Callable[[Any, str], None]
    host_rows: Callable[[], list[str]]


def _lost(sink: WarningSink) -> list[tuple[str, str]]:
    return [
        (w.workflow_id, w.cause) for w in sink.received if isinstance(w, WorkflowClaimLostWarning)
    ]


def _sqlite_site(tmp_path: Path) -> Site:
    path = tmp_path / "store.db"
    saved = tmp_path / "backup.db"
    table = "t_" + uuid.uuid4().hex[:12]
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE app (v TEXT NOT NULL)")
    conn.close()

    def backup() -> None:
        src, dst = sqlite3.connect(path), sqlite3.connect(saved)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()

    def restore() -> None:
        # What `cp backup.db store.db` does to a live store: the WAL is checkpointed first
        # (otherwise its newer frames would be replayed over the copy), then the file's bytes
        # are replaced in place, keeping its inode.
        conn = sqlite3.connect(path)
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            assert busy == 0, "the checkpoint before the restore was blocked by a reader"
        finally:
            conn.close()
        data = saved.read_bytes()
        inode = path.stat().st_ino
        with open(path, "r+b") as live:
            live.write(data)
            live.truncate(len(data))
        assert path.stat().st_ino == inode

    def host_insert(conn: Any, value: str) -> None:
        conn.execute("INSERT INTO app (v) VALUES (?)", (value,))

    def host_rows() -> list[str]:
        conn = sqlite3.connect(path)
        try:
            return [v for (v,) in conn.execute("SELECT v FROM app ORDER BY rowid")]
        finally:
            conn.close()

    return Site(
        url=f"sqlite:///{path}?table={table}",
        backup=backup,
        restore=restore,
        host_connect=lambda: sqlite3.connect(path),
        host_insert=host_insert,
        host_rows=host_rows,
    )


def _postgres_site(base: str) -> Site:
    import psycopg

    table = "t_" + uuid.uuid4().hex[:12]
    saved = table + "_backup"
    app = "app_" + uuid.uuid4().hex[:12]
    sep = "&" if "?" in base else "?"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{app}" (v text NOT NULL)')

    def backup() -> None:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{saved}" AS SELECT * FROM "{table}"')

    def restore() -> None:
        with psycopg.connect(base) as conn, conn.transaction():
            conn.execute(f'DELETE FROM "{table}"')
            conn.execute(f'INSERT INTO "{table}" SELECT * FROM "{saved}"')

    def host_insert(conn: Any, value: str) -> None:
        conn.execute(f'INSERT INTO "{app}" (v) VALUES (%s)', (value,))

    def host_rows() -> list[str]:
        with psycopg.connect(base, autocommit=True) as conn:
            return [v for (v,) in conn.execute(f'SELECT v FROM "{app}" ORDER BY v')]

    return Site(
        url=f"{base}{sep}table={table}",
        backup=backup,
        restore=restore,
        host_connect=lambda: psycopg.connect(base),
        host_insert=host_insert,
        host_rows=host_rows,
    )


@pytest.fixture
def site(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Site:
    if backend == "sqlite":
        return _sqlite_site(tmp_path)
    return _postgres_site(request.getfixturevalue("postgres_base_url"))


@pytest.fixture
def engines(site: Site) -> Iterator[Callable[[str, WarningSink], Ownership]]:
    opened: list[Ownership] = []
    clock = ManualClock(1_000_000)

    def open_engine(engine_id: str, sink: WarningSink) -> Ownership:
        storage = open_storage(site.url)
        own = Ownership.open(
            storage,
            engine_id=engine_id,
            options=OPTIONS,
            clock=clock,
            background="manual",
            warn=sink,
            is_eligible=lambda workflow_type, revision: True,
        )
        opened.append(own)
        return own

    yield open_engine
    for own in opened:
        own.close()
        own.storage.close()


def test_the_owner_of_a_re_minted_epoch_number_has_no_write_accepted(
    site: Site, engines: Callable[[str, WarningSink], Ownership]
) -> None:
    sink_a, sink_c = WarningSink(), WarningSink()
    a = engines("engine-a", sink_a)
    a.workflows.start(X, "job")
    assert a.registry.release(X).status == "released"
    site.backup()  # X at epoch 1, unclaimed
    a.workflows.resume(X)
    assert a.registry.current_epoch(X) == 2
    a.workflows.save_checkpoint(X, b"a-before-restore")
    token_a = a.registry.current_epoch_bytes(X)

    site.restore()
    c = engines("engine-c", sink_c)
    c.workflows.resume(X)
    token_c = c.registry.current_epoch_bytes(X)
    assert c.registry.current_epoch(X) == 2  # the number was handed out again
    assert token_a is not None and token_c is not None and token_a != token_c
    assert decode_epoch(c.storage.get(keys.workflow_owner_epoch(X))) == 2

    accepted_a = 0
    conn = site.host_connect()
    try:
        with pytest.raises(EngineDeposedError) as host_refused, a.fenced(X, conn) as host:
            site.host_insert(host, "a-after-restore")
            accepted_a += 1
    finally:
        conn.close()
    assert host_refused.value.cause == "store_rollback"
    with pytest.raises(EngineDeposedError) as ledger_refused:
        a.workflows.save_checkpoint(X, b"a-after-restore")
        accepted_a += 1
    assert ledger_refused.value.cause == "store_rollback"
    assert accepted_a == 0

    # A noticed the store went back in time: its claims are lost, reported once each.
    assert a.registry.list_held_workflow_ids() == []
    assert _lost(sink_a) == [(X, "store_rollback")]
    assert a.metrics.snapshot().lost["store_rollback"] == 1

    # The new owner's writes are the ones that land.
    c.workflows.save_checkpoint(X, b"c")
    assert c.workflows.load_checkpoint(X) == b"c"
    conn = site.host_connect()
    try:
        with c.fenced(X, conn) as host:
            site.host_insert(host, "c")
    finally:
        conn.close()
    assert site.host_rows() == ["c"]
    assert sink_c.received == []


def test_a_renewal_after_a_restore_notices_the_rollback_and_loses_every_claim(
    site: Site, engines: Callable[[str, WarningSink], Ownership]
) -> None:
    sink = WarningSink()
    a = engines("engine-a", sink)
    a.workflows.start(X, "job")
    a.workflows.start("Y", "job")
    site.backup()  # both at epoch 1, held by A with the holders written at the start
    a.registry.release(X)
    a.workflows.resume(X)  # X at epoch 2
    site.restore()

    outcomes = a.registry.renew_many([X, "Y"])
    # Y's renewal committed (its holder was restored unchanged), but nothing A remembers of a
    # store that forgot writes is trusted: Y is lost locally too.
    assert [(o.status, o.cause) for o in outcomes] == [
        ("lost", "store_rollback"),
        ("lost", "store_rollback"),
    ]
    assert a.registry.list_held_workflow_ids() == []
    assert sorted(_lost(sink)) == [
        (X, "store_rollback"),
        ("Y", "store_rollback"),
    ]
