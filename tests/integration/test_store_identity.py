"""A SQLite file deleted, replaced or stripped of its WAL under a running engine: the engine stops
writing to it and says so, naming the path, instead of writing on into a file nobody else sees.

Faults are real: ``os.unlink`` and ``os.replace`` on the files an open engine uses, and a second
engine opening whatever is at the path afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from weft_sync import ManualClock, Ownership, OwnershipOptions
from weft_sync.errors import EngineDeposedError, StoreIdentityError, WeftError
from weft_sync.storage import SqliteStorage

WORKFLOWS = 5
OPTIONS = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def engine_a(db_path: Path) -> Iterator[Ownership]:
    """A running engine holding ``WORKFLOWS`` workflows, maintained by hand."""
    ownership = Ownership.open(
        f"sqlite:///{db_path}",
        options=OPTIONS,
        background="manual",
        clock=ManualClock(1_000_000),
        warn=lambda _w: None,
    )
    for i in range(WORKFLOWS):
        ownership.workflows.start(f"wf-{i}", "report")
        ownership.workflows.save_checkpoint(f"wf-{i}", b"step-0")
    try:
        yield ownership
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ownership.close(timeout=5)


def _accepted_writes(ownership: Ownership, value: bytes) -> tuple[int, list[WeftError]]:
    """Try one checkpoint per workflow; return how many the engine accepted, and the errors."""
    accepted = 0
    errors: list[WeftError] = []
    for i in range(WORKFLOWS):
        try:
            ownership.workflows.save_checkpoint(f"wf-{i}", value)
        except WeftError as exc:
            errors.append(exc)
        else:
            accepted += 1
    return accepted, errors


def _assert_refuses_everything(ownership: Ownership, db_path: Path, detail: str) -> None:
    ownership.run_maintenance()
    accepted, errors = _accepted_writes(ownership, b"after-the-fault")
    assert accepted == 0
    assert len(errors) == WORKFLOWS
    for exc in errors:
        # The pass lost every claim locally (so the write is refused as deposed), or the write
        # met the store's identity error itself.
        assert isinstance(exc, (StoreIdentityError, EngineDeposedError))
    # Every claim was lost for the store's identity, and the store names the path and the fault.
    assert ownership.metrics.snapshot().lost["store_identity"] == WORKFLOWS
    assert ownership.registry.list_held_workflow_ids() == []
    # Reads fail too: the engine no longer trusts anything it would read from that file.
    with pytest.raises(StoreIdentityError) as info:
        ownership.storage.get("wf:wf-0")
    assert info.value.location == str(db_path)
    assert str(db_path) in str(info.value)
    assert detail in info.value.detail


def _unlink_all(db_path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        os.unlink(f"{db_path}{suffix}")


def test_a_deleted_database_gets_no_more_writes_from_the_engine_that_had_it_open(
    engine_a: Ownership, db_path: Path
) -> None:
    _unlink_all(db_path)
    _assert_refuses_everything(engine_a, db_path, "was deleted")


def test_a_second_engine_on_the_fresh_file_is_not_shadowed_by_the_first(
    engine_a: Ownership, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _unlink_all(db_path)
    # B opens the path, gets an empty store and starts the same ids; it says what it found.
    with caplog.at_level(logging.WARNING, logger="weft_sync.storage.sqlite.store"):
        engine_b = Ownership.open(f"sqlite:///{db_path}", options=OPTIONS, background="manual")
    assert any(
        "lock file of a deleted one" in r.getMessage() and str(db_path) in r.getMessage()
        for r in caplog.records
    )
    with engine_b:
        for i in range(WORKFLOWS):
            engine_b.workflows.start(f"wf-{i}", "report")
        accepted, _ = _accepted_writes(engine_a, b"from-a")
        assert accepted == 0
        for i in range(WORKFLOWS):
            engine_b.workflows.save_checkpoint(f"wf-{i}", b"from-b")
            assert engine_b.workflows.load_checkpoint(f"wf-{i}") == b"from-b"


def test_a_replaced_database_gets_no_more_writes_from_the_engine_that_had_it_open(
    engine_a: Ownership, db_path: Path, tmp_path: Path
) -> None:
    # cp + mv: a copy of the file (as a backup restore would) renamed over the path.
    copy = tmp_path / "copy.db"
    with sqlite3.connect(db_path) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    os.replace(copy, db_path)
    with Ownership.open(f"sqlite:///{db_path}", options=OPTIONS, background="manual") as engine_b:
        _assert_refuses_everything(engine_a, db_path, "was replaced")
        # The copy is a store of its own, untouched by A after the replacement.
        assert engine_b.workflows.load_checkpoint("wf-0") == b"step-0"


@pytest.mark.parametrize(("suffix", "detail"), [("-wal", "write-ahead log"), ("-shm", "WAL index")])
def test_a_deleted_wal_or_wal_index_stops_the_engine(
    engine_a: Ownership, db_path: Path, suffix: str, detail: str
) -> None:
    os.unlink(f"{db_path}{suffix}")
    _assert_refuses_everything(engine_a, db_path, detail)


def test_the_maintenance_pass_finds_the_fault_before_any_write(
    engine_a: Ownership, db_path: Path
) -> None:
    _unlink_all(db_path)
    engine_a.run_maintenance()
    # Found by the pass: the storage now refuses every call, reads included.
    with pytest.raises(StoreIdentityError, match="was deleted"):
        engine_a.storage.scan("wf:")


def test_a_file_overwritten_in_place_by_another_store_is_found_by_its_store_id(
    db_path: Path, tmp_path: Path
) -> None:
    other_path = tmp_path / "other.db"
    with SqliteStorage(other_path) as other:
        other.put("k", b"other")
    with SqliteStorage(db_path) as store:
        store.put("k", b"mine")
        store.verify_identity()
        # Same inode, other content (a restore that writes into the file).
        with open(other_path, "rb") as src, open(db_path, "r+b") as dst:
            shutil.copyfileobj(src, dst)
            dst.truncate()
        with pytest.raises(StoreIdentityError, match="holds another store"):
            store.verify_identity()
        with pytest.raises(StoreIdentityError):
            store.put("k", b"again")


def _overwrite_header(db_path: Path) -> None:
    """What ``dd if=/dev/zero of=store.db bs=100 count=1 conv=notrunc`` does: same inode, same
    size, no SQLite header."""
    with open(db_path, "r+b") as dst:
        dst.write(bytes(100))


def test_a_header_overwritten_in_place_is_found_by_the_identity_check(db_path: Path) -> None:
    with SqliteStorage(db_path) as store:
        store.put("k", b"mine")
        store.verify_identity()
        _overwrite_header(db_path)
        # The store's own connections still work from SQLite's cache of the file...
        store.put("k", b"cached")
        with pytest.raises(StoreIdentityError, match="no longer holds a SQLite database"):
            store.verify_identity()
        # ...and from the failed check on, every call is refused.
        with pytest.raises(StoreIdentityError):
            store.put("k", b"again")


def test_a_running_engine_stops_at_the_next_pass_after_its_header_is_overwritten(
    engine_a: Ownership, db_path: Path
) -> None:
    engine_a.run_maintenance()
    _overwrite_header(db_path)
    _assert_refuses_everything(engine_a, db_path, "no longer holds a SQLite database")


def test_an_untouched_store_passes_its_checks_across_reopening(db_path: Path) -> None:
    with SqliteStorage(db_path) as first:
        first.put("k", b"v")
        first.verify_identity()
        store_id = first._identity.store_id
    assert store_id != 0
    with SqliteStorage(db_path) as second:
        second.verify_identity()
        assert second._identity.store_id == store_id
        assert second.get("k") == b"v"


# -- one store, one path --------------------------------------------------------------------


def test_a_hard_linked_database_is_refused_naming_both_names(
    engine_a: Ownership, db_path: Path
) -> None:
    second = db_path.with_name("second-name.db")
    os.link(db_path, second)
    for path in (second, db_path):
        with pytest.raises(StoreIdentityError) as raised:
            SqliteStorage(path)
        message = str(raised.value)
        assert "2 hard links" in message
        assert str(db_path) in message and str(second) in message
        # Refused as it opened: no engine had it, so no claim is said to be lost.
        assert raised.value.at_open and "cannot be opened" in message
        assert "no longer the one" not in message and "treated as lost" not in message


def test_a_store_opened_through_a_symlink_is_the_same_store(
    engine_a: Ownership, db_path: Path, tmp_path: Path
) -> None:
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "via-link.db").symlink_to(db_path)
    with SqliteStorage(link_dir / "via-link.db") as through_link:
        # The same records, and the same session locks (named after the real path).
        assert through_link.get("wf-x") is None
        held = through_link.held_session_locks([engine_a.engine_id])
        assert held == {engine_a.engine_id}


_BIND_SCRIPT = """
import sys
from weft_sync.errors import StoreIdentityError
from weft_sync.storage import SqliteStorage
try:
    SqliteStorage(sys.argv[1]).close()
except StoreIdentityError as exc:
    print("refused:", exc)
else:
    print("opened")
"""


def test_a_bind_mounted_database_is_refused_while_open_through_its_own_path(
    engine_a: Ownership, db_path: Path, tmp_path: Path
) -> None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare or mount is not installed")
    target = tmp_path / "elsewhere" / "mounted.db"
    target.parent.mkdir()
    target.touch()
    # The mount lives only in the child's mount namespace, and ends with it.
    command = f"mount --bind {db_path} {target} && {sys.executable} -c '{_BIND_SCRIPT}' {target}"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        check=False,
    )
    if done.returncode != 0 and "mount" in done.stderr and "opened" not in done.stdout:
        pytest.skip(f"this machine does not allow a bind mount: {done.stderr.strip()[:200]}")
    assert done.stdout.startswith("refused:"), (done.stdout, done.stderr)
    assert str(target) in done.stdout and str(db_path) in done.stdout
