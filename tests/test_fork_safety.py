"""Fork safety: a forked child inherits no claims, timers or pools, and opens its own Ownership.

Children report through their exit code and write a traceback to a file when a check fails. They
leave with ``os._exit`` so nothing of the parent's test session runs in them. The parent then
checks that the child did not touch its claims and that they still renew.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.claims.gated import WarningSink
from tests.forking import expected_fork_warning, fork_child, wait_child
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder
from weft_sync.errors import ClosedError, WorkflowClaimLostError, WorkflowClaimUnavailableError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import (
    Put,
    SqliteStorage,
    Storage,
    storage_compare_and_set_many,
    storage_get_many,
)

TTL_MS = 3_000
RENEW_MS = 1_000
START_MS = 1_000_000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
CHILD_TIMEOUT_S = 30.0

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()"),
]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def parent(storage_url: str, clock: ManualClock) -> Iterator[Ownership]:
    """The parent's Ownership, in interval mode so a timer and pool exist at fork time."""
    ownership = Ownership.open(
        storage_url,
        options=OPTIONS,
        clock=clock,
        engine_id="parent-engine",
        warn=WarningSink(),
    )
    yield ownership
    ownership.close()


def _holder(storage: Storage, workflow_id: str) -> tuple[str, int, int] | None:
    holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    return None if holder is None else (holder.engine_id, holder.epoch, holder.expires_at)


def _expect_closed(use: Callable[[], object], what: str) -> None:
    """Assert that ``use`` raises ClosedError naming ``what``, the fork and the fix.

    ``what`` is ``"Class.method"``: the object itself must refuse, not something beneath it.
    """
    try:
        use()
    except ClosedError as exc:
        message = str(exc)
        assert message.startswith(f"{what}() was called in process {os.getpid()}"), message
        assert "os.fork()" in message and "in the child process" in message, message
    else:
        raise AssertionError(f"{what}() was still usable in the forked child")


def _check_inherited_ownership_is_inert(inherited: Ownership) -> None:
    """What every child asserts about the Ownership it inherited (and everything it holds)."""
    assert inherited.closed
    assert not inherited.started
    _expect_closed(lambda: inherited.claim("wf-child").__enter__(), "Ownership.claim")
    _expect_closed(inherited.run_maintenance, "Ownership.run_maintenance")
    _expect_closed(inherited.start, "Ownership.start")
    registry = inherited.registry
    _expect_closed(registry.list_held_workflow_ids, "ClaimRegistry.list_held_workflow_ids")
    _expect_closed(lambda: inherited.workflows.start("wf-child", "job"), "Workflows.start")
    storage = inherited.storage
    _expect_closed(lambda: storage.get("k"), f"{type(storage).__name__}.get")
    inherited.close()


def _open_own_and_check_the_parents_claim(store: str | Storage) -> None:
    """Open the child's own Ownership on the same store (a URL or an inherited Storage)."""
    with Ownership.open(
        store, options=OPTIONS, clock=ManualClock(START_MS), engine_id="child-engine"
    ) as own:
        assert own.started
        try:
            with own.claim("wf-parent"):
                raise AssertionError("the child acquired the parent's live claim")
        except WorkflowClaimUnavailableError as exc:
            assert exc.held_by == "parent-engine", exc.held_by
        with own.claim("wf-child") as handle:
            assert handle.epoch == 1
            handle.assert_held()


def _assert_child_passed(code: int | None, report: Path) -> None:
    details = report.read_text() if report.exists() else ""
    assert code == 0, f"child failed with exit code {code}:\n{details}"


def test_os_fork_child_holds_nothing_and_the_parent_keeps_renewing(
    parent: Ownership, clock: ManualClock, storage_url: str, storage: Storage, tmp_path: Path
) -> None:
    report = tmp_path / "child.txt"
    claim = parent.claim("wf-parent")
    handle = claim.__enter__()
    before = _holder(storage, "wf-parent")

    def child() -> None:
        # The child continues inside the parent's claim block: it must not own the claim.
        assert handle.lost.is_set()
        try:
            handle.assert_held()
        except WorkflowClaimLostError:
            pass
        else:
            raise AssertionError("assert_held() passed in the child")
        _check_inherited_ownership_is_inert(parent)
        try:
            claim.__exit__(None, None, None)
        except WorkflowClaimLostError:
            pass
        else:
            raise AssertionError("leaving the inherited claim block did not report the loss")
        _open_own_and_check_the_parents_claim(storage_url)

    wait_child(fork_child(child, report, CHILD_TIMEOUT_S), report, CHILD_TIMEOUT_S)

    assert _holder(storage, "wf-parent") == before
    assert _holder(storage, "wf-child") is None
    assert not handle.lost.is_set()
    clock.advance(RENEW_MS)
    result = parent.run_maintenance()
    assert (result.renewed_count, result.failed_count) == (1, 0)
    assert _holder(storage, "wf-parent") == ("parent-engine", 1, START_MS + RENEW_MS + TTL_MS)
    handle.assert_held()
    claim.__exit__(None, None, None)
    assert _holder(storage, "wf-parent") is None


def _every_method_family(inherited: Ownership) -> dict[str, Callable[[], object]]:
    """One call of every public method of the inherited objects, by name."""
    wf, reg, store = inherited.workflows, inherited.registry, inherited.storage
    put = [Put("k", b"v")]
    uses: dict[str, Callable[[], object]] = {
        "Ownership.claim": lambda: inherited.claim("wf-parent").__enter__(),
        "Ownership.run_maintenance": inherited.run_maintenance,
        "Ownership.start": inherited.start,
        "Ownership.on_lost": lambda: inherited.on_lost(print),
        "Workflows.start": lambda: wf.start("wf-child", "job"),
        "Workflows.get": lambda: wf.get("wf-parent"),
        "Workflows.get_outcome": lambda: wf.get_outcome("wf-parent"),
        "Workflows.load_checkpoint": lambda: wf.load_checkpoint("wf-parent"),
        "Workflows.list": wf.list,
        "Workflows.registry": lambda: wf.registry,
        "Workflows.save_checkpoint": lambda: wf.save_checkpoint("wf-parent", b"child"),
        "Workflows.fenced_write": lambda: wf.fenced_write("wf-parent", put),
        "Workflows.complete": lambda: wf.complete("wf-parent", "child"),
        "Workflows.fail": lambda: wf.fail("wf-parent", "child"),
        "Workflows.cancel": lambda: wf.cancel("wf-parent"),
        "Workflows.timeout": lambda: wf.timeout("wf-parent"),
        "Workflows.suspend": lambda: wf.suspend("wf-parent"),
        "Workflows.resume": lambda: wf.resume("wf-parent"),
        "Workflows.purge": lambda: wf.purge("wf-parent"),
        "Workflows.send_signal": lambda: wf.send_signal("wf-parent", "go"),
        "Workflows.wait_for_signal": lambda: wf.wait_for_signal("wf-parent", "go", 0.01),
        "Workflows.submit_update": lambda: wf.submit_update("wf-parent", "u"),
        "Workflows.on_update": lambda: wf.on_update("wf-parent", None),
        "ClaimRegistry.current_epoch": lambda: reg.current_epoch("wf-parent"),
        "ClaimRegistry.current_epoch_bytes": lambda: reg.current_epoch_bytes("wf-parent"),
        "ClaimRegistry.list_held_workflow_ids": reg.list_held_workflow_ids,
        "ClaimRegistry.acquire": lambda: reg.acquire("wf-child"),
        "ClaimRegistry.prepare_acquire_fragment": lambda: reg.prepare_acquire_fragment("wf-c"),
        "ClaimRegistry.renew": lambda: reg.renew("wf-parent"),
        "ClaimRegistry.renew_many": lambda: reg.renew_many(["wf-parent"]),
        "ClaimRegistry.renew_many_outcomes": lambda: reg.renew_many_outcomes(["wf-parent"]),
        "ClaimRegistry.release": lambda: reg.release("wf-parent"),
        "ClaimRegistry.release_all": reg.release_all,
        "ClaimRegistry.forget_local_claim": lambda: reg.forget_local_claim("wf-parent"),
        "ClaimRegistry.takeover": lambda: reg.takeover("wf-parent"),
        "ClaimRegistry.takeover_many": lambda: reg.takeover_many(["wf-parent"]),
        "Storage.get": lambda: store.get("k"),
        "Storage.get_many": lambda: storage_get_many(store, ["k"]),
        "Storage.scan": store.scan,
        "Storage.put": lambda: store.put("k", b"v"),
        "Storage.delete": lambda: store.delete("k"),
        "Storage.batch": lambda: store.batch(put),
        "Storage.conditional_batch": lambda: store.conditional_batch([], put),
        "Storage.conditional_batches": lambda: store.conditional_batches([([], put)]),
        "Storage.compare_and_set_many": lambda: storage_compare_and_set_many(
            store, [("k", b"a", b"b")]
        ),
    }
    if isinstance(store, SqliteStorage):
        uses["SqliteStorage.dict_view"] = store.dict_view
    return uses


def test_every_inherited_object_refuses_every_method_in_the_child_and_writes_nothing(
    parent: Ownership, storage: Storage, tmp_path: Path
) -> None:
    report = tmp_path / "child.txt"
    parent.workflows.start("wf-parent", "job", input={"n": 1})
    parent.workflows.save_checkpoint("wf-parent", b"parent")
    before = storage.scan()

    def child() -> None:
        kind = type(parent.storage).__name__
        for what, use in _every_method_family(parent).items():
            _expect_closed(use, kind + what[7:] if what.startswith("Storage.") else what)
        # close() of each inherited object is quiet and lets go of nothing the parent uses.
        parent.workflows.close()
        parent.storage.close()
        parent.close()

    wait_child(fork_child(child, report, CHILD_TIMEOUT_S), report, CHILD_TIMEOUT_S)

    assert storage.scan() == before
    assert parent.workflows.load_checkpoint("wf-parent") == b"parent"
    result = parent.run_maintenance()
    assert (result.renewed_count, result.failed_count) == (1, 0)
    parent.workflows.save_checkpoint("wf-parent", b"after the child")
    assert parent.workflows.complete("wf-parent", "done").status == "completed"


def _multiprocessing_child(
    inherited: Ownership, storage: Storage, storage_url: str, report: str
) -> None:
    try:
        _check_inherited_ownership_is_inert(inherited)
        _expect_closed(lambda: storage.put("k", b"v"), f"{type(storage).__name__}.put")
        storage.close()  # lets go of the inherited copies; the parent's storage stays open
        _open_own_and_check_the_parents_claim(storage_url)
    except BaseException:
        Path(report).write_text(traceback.format_exc())
        raise SystemExit(1) from None


def test_multiprocessing_fork_child_can_open_its_own_ownership_on_the_same_store(
    parent: Ownership, storage: Storage, storage_url: str, tmp_path: Path
) -> None:
    report = tmp_path / "child.txt"
    assert parent.registry.acquire("wf-parent").status == "acquired"
    before = _holder(storage, "wf-parent")
    process = multiprocessing.get_context("fork").Process(
        target=_multiprocessing_child,
        args=(parent, storage, storage_url, str(report)),
        name="weft-fork-child",
    )

    with expected_fork_warning():  # the parent runs interval maintenance: threads at fork
        process.start()
    process.join(CHILD_TIMEOUT_S)

    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError("the forked child did not finish")
    _assert_child_passed(process.exitcode, report)
    assert _holder(storage, "wf-parent") == before
    assert parent.registry.current_epoch("wf-parent") == 1
    result = parent.run_maintenance()
    assert (result.renewed_count, result.failed_count) == (1, 0)
    with parent.claim("wf-child") as handle:
        assert handle.epoch == 2


# A parent that forks a child which exits the normal way (atexit handlers, interpreter
# finalisation, garbage collection of everything it inherited), then checks that nothing of its
# own was disturbed: its claims still renew, its writes still land and, on PostgreSQL, its very
# sessions (backend pids) survived the child.
_NORMAL_EXIT_SCRIPT = """
import os, sys, time
from weft_sync.errors import ClosedError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership

url, app, raw_dsn = sys.argv[1], sys.argv[2], sys.argv[3]
options = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)


def sessions():
    if not app:
        return set()
    import psycopg

    with psycopg.connect(raw_dsn, autocommit=True) as raw:
        rows = raw.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", [app + " %"]
        ).fetchall()
    return {row[0] for row in rows}


parent = Ownership.open(url, options=options, background="manual", engine_id="parent")
block = parent.claim("wf-parent")
handle = block.__enter__()
parent.workflows.start("wf-run", "job")
parent.drivers.enter("wf-run", 1, "the script's thread")  # driven here until complete()
before = sessions()
pid = os.fork()
if pid == 0:
    try:
        parent.workflows.save_checkpoint("wf-run", b"child")
    except ClosedError:
        pass
    else:
        sys.exit(3)
    with Ownership.open(url, options=options, background="manual", engine_id="child") as own:
        own.workflows.start("wf-child", "job")
        own.workflows.complete("wf-child", 1)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert sessions() == before, (sessions(), before)
for _ in range(3):
    result = parent.run_maintenance()
    assert (result.renewed_count, result.failed_count) == (2, 0), result
assert sessions() == before, (sessions(), before)
parent.workflows.save_checkpoint("wf-run", b"parent")
assert parent.workflows.complete("wf-run", 2).status == "completed"
assert parent.workflows.get("wf-child").status == "completed"
handle.assert_held()
block.__exit__(None, None, None)
parent.close()
print("parent undisturbed")
"""


def test_a_child_that_exits_normally_leaves_the_parents_claims_and_sessions_alone(
    storage_url: str, backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    app = raw_dsn = ""
    url = storage_url
    if backend == "postgres":
        app = "weft-fork-exit-" + uuid.uuid4().hex[:8]
        url = f"{storage_url}&application_name={app}"
        raw_dsn = str(request.getfixturevalue("postgres_base_url"))
    script = tmp_path / "parent.py"
    script.write_text(_NORMAL_EXIT_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    done = subprocess.run(
        [sys.executable, str(script), url, app, raw_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "parent undisturbed"
