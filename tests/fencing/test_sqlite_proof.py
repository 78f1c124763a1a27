"""The SQLite same-file proof when what a connection has open changes between two blocks.

The proof of a sqlite3 connection is not cached per connection (it takes no weak reference and
its ``id()`` can be reused); the binding last proven is only a first guess, re-checked on every
block by ``PRAGMA database_list``. These tests change the
connection's files behind that guess — ``DETACH`` and ``ATTACH`` of a copy under the same name,
``deserialize()``, a closed connection replaced by one on a copy — with a copy that holds the
very epoch the fence expects, so only the proof can refuse it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pytest

from tests.fencing.hosts import HostEnv, make_env
from weft_sync import Ownership, keys
from weft_sync.errors import (
    EngineDeposedError,
    StorageCapabilityError,
    StorageError,
    StoreIdentityError,
    WorkflowClaimLostWarning,
)

WID = "wf-1"


@pytest.fixture
def env(sqlite3_env: HostEnv) -> HostEnv:
    """The cases of this module run on ``sqlite3`` only."""
    return sqlite3_env


def _held(env: HostEnv) -> Ownership:
    own = env.ownership()
    own.registry.acquire(WID)
    return own


def _copy(env: HostEnv, tmp_path: Path, name: str = "copy.db") -> str:
    """A byte copy of the store (same epochs, same host table) on another file."""
    src = sqlite3.connect(env.db_url)
    dst = sqlite3.connect(str(tmp_path / name))
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return str(tmp_path / name)


def _image(env: HostEnv, tmp_path: Path) -> bytes:
    """A serialized copy of the store, ready for ``deserialize()``."""
    image = sqlite3.connect(_copy(env, tmp_path))
    try:
        image.execute("PRAGMA journal_mode = DELETE")  # an in-memory database cannot use WAL
        return image.serialize()
    finally:
        image.close()


def _store_table(env: HostEnv) -> str:
    return env.storage_url.rsplit("table=", 1)[1]


def _fenced_write(own: Ownership, conn: sqlite3.Connection, table: str, value: str) -> None:
    with own.fenced(WID, conn):
        conn.execute(f"INSERT OR REPLACE INTO {table} (id, v) VALUES ('row', ?)", (value,))


def test_reattached_copy_under_the_proven_name_is_refused(env: HostEnv, tmp_path: Path) -> None:
    own = _held(env)
    copy = _copy(env, tmp_path)
    conn = sqlite3.connect(str(tmp_path / "host-main.db"), isolation_level=None)
    try:
        conn.execute("ATTACH DATABASE ? AS weft", (env.db_url,))
        _fenced_write(own, conn, f"weft.{env.table}", "1")
        conn.execute("DETACH DATABASE weft")
        conn.execute("ATTACH DATABASE ? AS weft", (copy,))
        with pytest.raises(StorageCapabilityError) as err:
            _fenced_write(own, conn, f"weft.{env.table}", "2")
        assert "copy.db" in str(err.value) and "shared.db" in str(err.value)
        assert not conn.in_transaction
    finally:
        conn.close()
    assert env.rows() == {"row": "1"}
    assert sqlite3.connect(copy).execute(f"SELECT v FROM {env.table}").fetchall() == []


def test_detached_store_is_refused(env: HostEnv, tmp_path: Path) -> None:
    own = _held(env)
    conn = sqlite3.connect(str(tmp_path / "host-main.db"), isolation_level=None)
    try:
        conn.execute("ATTACH DATABASE ? AS weft", (env.db_url,))
        _fenced_write(own, conn, f"weft.{env.table}", "1")
        conn.execute("DETACH DATABASE weft")
        with pytest.raises(StorageCapabilityError, match=r"host-main\.db"):
            _fenced_write(own, conn, "nowhere", "2")
    finally:
        conn.close()


@pytest.mark.parametrize("cwd_has_it", [False, True], ids=["plain", "bare-name-in-cwd"])
def test_deserialized_connection_is_refused(
    env: HostEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cwd_has_it: bool
) -> None:
    """The same object then holds an in-memory image of the store, epochs included. SQLite
    reports it under a bare name (``x``), never a path: a file of that name in the working
    directory — a link to the store itself — does not make it the store either."""
    own = _held(env)
    data = _image(env, tmp_path)
    conn = sqlite3.connect(env.db_url, isolation_level=None)
    try:
        _fenced_write(own, conn, env.table, "1")
        conn.deserialize(data)
        bare = conn.execute("PRAGMA database_list").fetchall()[0][2]
        assert bare and not Path(bare).is_absolute()
        if cwd_has_it:
            (tmp_path / "cwd").mkdir()
            (tmp_path / "cwd" / bare).symlink_to(env.db_url)
            monkeypatch.chdir(tmp_path / "cwd")
        with pytest.raises(StorageCapabilityError, match=r"in memory|shared\.db"):
            _fenced_write(own, conn, env.table, "2")
    finally:
        conn.close()
    assert env.rows() == {"row": "1"}


def test_a_proven_block_runs_only_its_own_statements(env: HostEnv) -> None:
    """After the first block, a block is the host's statements plus BEGIN IMMEDIATE, the
    re-check pragma, the epoch read, the epoch read again (the end check) and COMMIT."""
    own = _held(env)
    conn = sqlite3.connect(env.db_url, isolation_level=None)
    statements: list[str] = []
    try:
        _fenced_write(own, conn, env.table, "1")
        conn.set_trace_callback(statements.append)
        _fenced_write(own, conn, env.table, "2")
    finally:
        conn.close()
    fence = [sql for sql in statements if "INSERT OR REPLACE" not in sql]
    assert fence[0] == "BEGIN IMMEDIATE" and fence[-1] == "COMMIT"
    assert any(sql.startswith("SELECT value FROM") for sql in fence)
    assert len(fence) == 5, fence
    assert fence[1] == "PRAGMA database_list", fence
    assert fence[2] == fence[3] and fence[3].startswith("SELECT value FROM"), fence
    assert env.rows() == {"row": "2"}


def test_new_connection_on_a_copy_is_refused_after_a_proven_one(
    env: HostEnv, tmp_path: Path
) -> None:
    own = _held(env)
    copy = _copy(env, tmp_path)
    for round_ in range(20):
        # Closing and dropping the proven connection first lets the next one reuse its id().
        proven = sqlite3.connect(env.db_url, isolation_level=None)
        _fenced_write(own, proven, env.table, str(round_))
        proven.close()
        del proven
        other = sqlite3.connect(copy, isolation_level=None)
        try:
            with pytest.raises(StorageCapabilityError, match=r"copy\.db"):
                _fenced_write(own, other, env.table, "copy")
        finally:
            other.close()
    assert env.rows() == {"row": "19"}


def test_proven_schema_of_one_connection_does_not_mislead_another(
    env: HostEnv, tmp_path: Path
) -> None:
    """A connection whose main file is a copy with a stale epoch and which has the store
    attached reads the epoch from the store, not from the schema another connection used."""
    own = _held(env)
    copy = _copy(env, tmp_path)
    stale = sqlite3.connect(copy, isolation_level=None)
    stale.execute(f"UPDATE {_store_table(env)} SET value = x'00'")
    stale.close()
    first = sqlite3.connect(env.db_url, isolation_level=None)
    second = sqlite3.connect(copy, isolation_level=None)
    try:
        _fenced_write(own, first, env.table, "main")  # proves the store as "main"
        second.execute("ATTACH DATABASE ? AS weft", (env.db_url,))
        _fenced_write(own, second, f"weft.{env.table}", "attached")
        _fenced_write(own, first, env.table, "main again")
    finally:
        first.close()
        second.close()
    assert env.rows() == {"row": "main again"}


def test_copy_is_refused_even_when_its_epoch_matches(env: HostEnv, tmp_path: Path) -> None:
    own = _held(env)
    copy = _copy(env, tmp_path)
    conn = sqlite3.connect(copy, isolation_level=None)
    try:
        with pytest.raises(StorageCapabilityError):
            _fenced_write(own, conn, env.table, "x")
    finally:
        conn.close()


def test_store_reached_through_a_symlink_is_accepted(env: HostEnv, tmp_path: Path) -> None:
    own = _held(env)
    link = tmp_path / "link.db"
    link.symlink_to(env.db_url)
    conn = sqlite3.connect(str(link), isolation_level=None)
    try:
        _fenced_write(own, conn, env.table, "via link")
    finally:
        conn.close()
    assert env.rows() == {"row": "via link"}


def test_changed_epoch_is_seen_through_the_guessed_binding(env: HostEnv) -> None:
    own = _held(env)
    conn = sqlite3.connect(env.db_url, isolation_level=None)
    try:
        _fenced_write(own, conn, env.table, "1")
        # Another engine's takeover, as the store sees it: the epoch row holds other bytes.
        conn.execute(
            f"UPDATE {_store_table(env)} SET value = x'00' WHERE key = ?",
            (keys.workflow_owner_epoch(WID),),
        )
        with pytest.warns(WorkflowClaimLostWarning), pytest.raises(EngineDeposedError):
            _fenced_write(own, conn, env.table, "2")
    finally:
        conn.close()
    assert env.rows() == {"row": "1"}


def test_a_file_that_stays_locked_is_a_storage_error(env: HostEnv) -> None:
    """Both the first block (proving the connection) and a later one (one call) give up on
    the write lock after the connection's busy timeout as StorageError, nothing begun."""
    own = _held(env)
    conn = sqlite3.connect(env.db_url, isolation_level=None, timeout=0.05)
    blocker = sqlite3.connect(env.db_url, isolation_level=None)
    try:
        for proven in (False, True):
            if proven:
                _fenced_write(own, conn, env.table, "ok")
            blocker.execute("BEGIN IMMEDIATE")
            try:
                with pytest.raises(StorageError, match="locked"):
                    _fenced_write(own, conn, env.table, "refused")
                assert not conn.in_transaction
            finally:
                blocker.execute("ROLLBACK")
    finally:
        blocker.close()
        conn.close()
    assert env.rows() == {"row": "ok"}


@pytest.mark.parametrize("driver", ["sqlalchemy-connection", "sqlalchemy-session"])
def test_sqlalchemy_blocks_recheck_the_same_way(tmp_path: Path, driver: str) -> None:
    """Through SQLAlchemy the proof is re-checked on the DBAPI ``sqlite3.Connection`` the same
    way: one pragma per block."""
    import sqlalchemy

    host = make_env("sqlite", driver, tmp_path, None)
    statements: list[str] = []
    try:
        engine = host._sa_engine("")
        sqlalchemy.event.listen(
            engine, "connect", lambda dbapi, _record: dbapi.set_trace_callback(statements.append)
        )
        own = host.ownership()
        own.registry.acquire(WID)
        conn = host.connect()
        for value in ("1", "2", "3"):
            with own.fenced(WID, conn) as yielded:
                host.write(yielded, "row", value)
        pragmas = sum("database_list" in sql for sql in statements)
        # The first block proves (one pragma) and the two after it re-check (one each).
        assert pragmas == 3, statements
        assert host.rows() == {"row": "3"}
    finally:
        host.close()


@pytest.mark.parametrize("proven", [False, True], ids=["first", "proven"])
def test_a_block_on_a_file_renamed_away_under_the_store_is_refused(
    env: HostEnv, tmp_path: Path, proven: bool
) -> None:
    """A restore that renames another file into place (and removes the ``-wal``/``-shm``)
    while the engine and the host's connection still have the old file open: SQLite still
    reports the path, so the proof passes, but the store's identity check before the commit
    refuses the block, and the engine loses its claims (``store_identity``); its later blocks
    are refused as deposed. Nothing reaches either file."""
    own = _held(env)
    conn = sqlite3.connect(env.db_url, isolation_level=None)
    try:
        if proven:
            _fenced_write(own, conn, env.table, "proof")
        else:
            # Not a block: the next one is the connection's first, but its files are open.
            conn.execute(f"SELECT count(*) FROM {env.table}").fetchone()
        restored = _copy(env, tmp_path, "restored.db")
        os.replace(restored, env.db_url)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(env.db_url + suffix)
        with pytest.warns(WorkflowClaimLostWarning), pytest.raises(StoreIdentityError):
            _fenced_write(own, conn, env.table, "into the old file")
        assert own.registry.current_epoch(WID) is None
        assert own.registry.loss_cause(WID) == "store_identity"
        with pytest.raises(EngineDeposedError):
            _fenced_write(own, conn, env.table, "again")
        old = conn.execute(f"SELECT v FROM {env.table}").fetchall()
    finally:
        conn.close()
    assert old == ([("proof",)] if proven else [])
    assert env.rows() == ({"row": "proof"} if proven else {})
