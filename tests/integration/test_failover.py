"""A real PostgreSQL failover under writing engines: streaming standby promoted.

Asynchronous: the standby stops receiving (it lags), engine A mints epoch 2 of X on the primary
and keeps writing, the primary is killed with writes in flight and the lagging standby is
promoted. Engine C takes X over there and mints epoch number 2 again. Not one write of A is
accepted after the promotion: its token is not C's.

Synchronous: every epoch the primary acknowledged is on the promoted standby.

The long version, with many workflows and engines, is ``bench/failover.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.claims.gated import WarningSink
from tests.cli.helpers import run_cli
from tests.pgreplica import ReplicaPair, start_pair
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_epoch
from weft_sync.errors import EngineDeposedError, StorageError, WeftError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import open_storage

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("postgres_base_url")]

OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)
PAST_GRACE_MS = 3_000 + 2 * 1_000 + 1
TABLE = "weft_failover"


def _engine(
    pair: ReplicaPair,
    engine_id: str,
    clock: ManualClock,
    sink: WarningSink,
    *,
    direct: bool = False,
) -> Ownership:
    url = pair.node_url(pair.standby) if direct else pair.url
    return Ownership.open(
        open_storage(f"{url}&table={TABLE}"),
        engine_id=engine_id,
        options=OPTIONS,
        clock=clock,
        background="manual",
        warn=sink,
        is_eligible=lambda workflow_type, revision: True,
    )


def _close(*engines: Ownership) -> None:
    for own in engines:
        own.close()
        own.storage.close()


@pytest.fixture
def async_pair() -> Iterator[ReplicaPair]:
    pair = start_pair(synchronous=False)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def sync_pair() -> Iterator[ReplicaPair]:
    pair = start_pair(synchronous=True)
    try:
        yield pair
    finally:
        pair.stop()


class _Writer(threading.Thread):
    """Saves checkpoints of one workflow in a loop; records when each write was accepted."""

    def __init__(self, own: Ownership, workflow_id: str) -> None:
        super().__init__(name="failover-writer", daemon=True)
        self._own, self._wid = own, workflow_id
        self.stop = threading.Event()
        self.accepted_at: list[float] = []
        self.deposed = threading.Event()
        self.cause: str | None = None

    def run(self) -> None:
        while not self.stop.is_set() and not self.deposed.is_set():
            try:
                self._own.workflows.save_checkpoint(self._wid, b"a")
                self.accepted_at.append(time.monotonic())
            except EngineDeposedError as exc:
                self.cause = exc.cause
                self.deposed.set()
            except StorageError:
                time.sleep(0.01)  # the primary is gone: retry until a server answers


def test_after_promoting_a_lagging_standby_no_stale_write_is_accepted(
    async_pair: ReplicaPair,
) -> None:
    clock = ManualClock(1_000_000)
    sink_a, sink_c = WarningSink(), WarningSink()
    a = _engine(async_pair, "engine-a", clock, sink_a)
    c: Ownership | None = None
    writer = _Writer(a, "X")
    try:
        a.workflows.start("X", "job")  # epoch 1, replicated
        async_pair.wait_replayed()
        async_pair.stop_standby()
        a.registry.release("X")
        a.workflows.resume("X")  # epoch 2: acknowledged by the primary only
        assert a.registry.current_epoch("X") == 2
        a_token = a.registry.current_epoch_bytes("X")
        writer.start()
        while len(writer.accepted_at) < 20:
            time.sleep(0.01)
        # The primary dies with A's writes in flight (they retry until a server answers).
        async_pair.fail_over(restart_standby=True, move_vip=False)
        promoted_at = time.monotonic()

        # A new engine comes up on the promoted standby before A's traffic reaches it.
        # C's clock is past A's holder there (epoch 1's); A's own clock does not move, so
        # nothing but the fence can stop A.
        clock_c = ManualClock(clock() + PAST_GRACE_MS)
        c = _engine(async_pair, "engine-c", clock_c, sink_c, direct=True)
        stored = c.storage.get(keys.workflow_owner_epoch("X"))
        assert decode_epoch(stored) == 1  # the standby never got epoch 2
        taken = c.registry.takeover("X")
        assert (taken.status, taken.epoch) == ("acquired", 2)  # the number is handed out again
        assert taken.token != a_token
        async_pair.move_vip()  # now A's retried writes reach the new primary
        assert writer.deposed.wait(60), "engine A's writes were neither refused nor accepted"
        writer.stop.set()
        writer.join(10)
        assert [t for t in writer.accepted_at if t > promoted_at] == []
        assert writer.cause == "store_rollback"
        c.workflows.save_checkpoint("X", b"c")
        assert c.workflows.load_checkpoint("X") == b"c"
        assert sink_c.received == []
    finally:
        writer.stop.set()
        if writer.is_alive():
            writer.join(10)
        _close(a, *([] if c is None else [c]))


def test_with_a_synchronous_standby_no_acknowledged_epoch_is_lost(sync_pair: ReplicaPair) -> None:
    clock = ManualClock(1_000_000)
    a = _engine(sync_pair, "engine-a", clock, WarningSink())
    acknowledged: dict[str, bytes] = {}
    ids = [f"wf-{i}" for i in range(8)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def mint_loop() -> None:
        # Release and resume in turn: every resume mints the next epoch of that workflow.
        n = 0
        while not stop.is_set():
            wid = ids[n % len(ids)]
            n += 1
            try:
                a.registry.release(wid)
                a.workflows.resume(wid)
            except WeftError:
                continue  # the primary is gone, or this id's claim is unavailable for now
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return
            token = a.registry.current_epoch_bytes(wid)
            if token is not None:
                acknowledged[wid] = token

    c: Ownership | None = None
    thread = threading.Thread(target=mint_loop, name="failover-minter", daemon=True)
    try:
        for wid in ids:
            a.workflows.start(wid, "job")
            acknowledged[wid] = a.registry.current_epoch_bytes(wid) or b""
        thread.start()
        deadline = time.monotonic() + 30
        while sum(decode_epoch(t) or 0 for t in acknowledged.values()) < 60:
            assert time.monotonic() < deadline, "the engine minted too few epochs"
            time.sleep(0.02)
        sync_pair.fail_over()
        stop.set()
        thread.join(60)
        assert not thread.is_alive() and errors == []
        c = _engine(sync_pair, "engine-c", clock, WarningSink())
        lost = []
        for wid, token in acknowledged.items():
            stored = c.storage.get(keys.workflow_owner_epoch(wid))
            number, held = decode_epoch(stored), decode_epoch(token)
            assert number is not None and held is not None
            # A commit in flight at the kill may be on the standby unacknowledged (higher).
            if number < held or (number == held and stored != token):
                lost.append((wid, held, number))
        assert lost == []
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(10)
        _close(a, *([] if c is None else [c]))


def test_doctor_names_each_replication_role_and_a_standby_refuses_to_open(
    sync_pair: ReplicaPair,
) -> None:
    primary = f"{sync_pair.node_url(sync_pair.primary)}&table={TABLE}"
    standby = f"{sync_pair.node_url(sync_pair.standby)}&table={TABLE}"
    open_storage(primary).close()  # creates the table
    sync_pair.wait_replayed()

    code, out = run_cli("--url", primary, "doctor")
    assert code == 0, out
    assert "[ok] replication: primary with synchronous standbys" in out
    assert "1 standby(s) streaming, 1 of them synchronous" in out

    code, out = run_cli("--url", standby, "doctor")
    assert code == 1
    assert "[FAIL] replication: this server is a standby" in out

    with pytest.raises(StorageError, match=r"is a standby .*point the store URL at the primary"):
        open_storage(standby)


def test_doctor_says_what_an_asynchronous_standby_means_for_fencing(
    async_pair: ReplicaPair,
) -> None:
    url = f"{async_pair.url}&table={TABLE}"
    open_storage(url).close()
    code, out = run_cli("--url", url, "doctor")
    assert code == 0, out
    assert "[info] replication: primary with asynchronous standbys only" in out
    assert "never the same token" in out
