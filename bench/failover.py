"""A PostgreSQL failover under load: does any stale write land, is any acknowledged epoch lost?

Starts a primary and a ``pg_basebackup -R`` standby (``tests/pgreplica.py``: the suite's server
binaries, Unix sockets, a symlinked socket directory standing for a virtual IP), then for each
``--mode``:

- ``async``: engine A starts ``--workflows`` workflows and ``--writers`` threads that keep
  releasing and resuming them (every resume mints the next epoch) and saving checkpoints. After
  ``--lag-after`` seconds the standby stops receiving; after ``--run`` more seconds the primary is
  killed (``-m immediate``) with writes in flight and the lagging standby promoted. Engine C comes
  up there first and takes every workflow over (re-minting every epoch number A had minted since
  the lag began); only then does A's traffic reach the new primary. Counts the epoch numbers
  handed out twice and the writes of A accepted after the promotion that were fenced on a token
  minted before it (stale: must be 0). A's later writes on claims it acquires afresh on the new
  primary (workflows nobody held there) are counted apart: they are not stale.
- ``sync``: the same load against a primary whose commits wait for the standby; the primary is
  killed and the standby promoted; counts the epochs A had been acknowledged that the new
  primary lacks (must be 0).

    python bench/failover.py [--mode async|sync|both] [--workflows 40] [--writers 4]
        [--lag-after 2] [--run 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.pgreplica import ReplicaPair, start_pair
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_epoch
from weft_sync.errors import EngineDeposedError, WeftError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import open_storage

OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)
PAST_GRACE_MS = 3_000 + 2 * 1_000 + 1
TABLE = "weft_failover_bench"


def _engine(url: str, engine_id: str, clock: ManualClock) -> Ownership:
    return Ownership.open(
        open_storage(f"{url}&table={TABLE}"),
        engine_id=engine_id,
        options=OPTIONS,
        clock=clock,
        background="manual",
        warn=lambda warning: None,
        is_eligible=lambda workflow_type, revision: True,
    )


@dataclass
class Load:
    """What engine A's writer threads did: acknowledged tokens and accepted writes."""

    acknowledged: dict[str, bytes] = field(default_factory=dict)
    minted: list[tuple[float, bytes]] = field(default_factory=list)
    accepted_at: list[tuple[float, bytes]] = field(default_factory=list)
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _writer(own: Ownership, ids: list[str], load: Load, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        wid = ids[n % len(ids)]
        n += 1
        try:
            if n % 3 == 0:
                own.registry.release(wid)
                own.workflows.resume(wid)
                token = own.registry.current_epoch_bytes(wid)
                if token is not None:
                    with load.lock:
                        load.acknowledged[wid] = token
                        load.minted.append((time.monotonic(), token))
            else:
                # Only this thread mints this id: the token read here is the one fenced on.
                token = own.registry.current_epoch_bytes(wid) or b""
                own.workflows.save_checkpoint(wid, b"a")
                with load.lock:
                    load.accepted_at.append((time.monotonic(), token))
        except EngineDeposedError:
            with load.lock:
                load.refused += 1
        except WeftError:
            time.sleep(0.005)  # the primary is gone, or this id is unavailable for now


def run(mode: str, workflows: int, writers: int, lag_after: float, run_s: float) -> list[str]:
    pair: ReplicaPair = start_pair(synchronous=mode == "sync")
    clock = ManualClock(1_000_000)
    a = _engine(pair.url, "engine-a", clock)
    c: Ownership | None = None
    load = Load()
    stop = threading.Event()
    ids = [f"wf-{i:04d}" for i in range(workflows)]
    threads: list[threading.Thread] = []
    try:
        for wid in ids:
            a.workflows.start(wid, "job")
            load.acknowledged[wid] = a.registry.current_epoch_bytes(wid) or b""
        pair.wait_replayed()
        chunks = [ids[i::writers] for i in range(writers)]
        threads = [
            threading.Thread(target=_writer, args=(a, chunk, load, stop), daemon=True)
            for chunk in chunks
        ]
        for t in threads:
            t.start()
        time.sleep(lag_after)
        if mode == "async":
            replicated = _epochs(pair, ids, standby=False)
            pair.stop_standby()
        time.sleep(run_s)
        pair.fail_over(restart_standby=mode == "async", move_vip=False)
        promoted_at = time.monotonic()
        with load.lock:
            acked = dict(load.acknowledged)
        clock_c = ManualClock(clock() + PAST_GRACE_MS)
        c = _engine(pair.node_url(pair.standby), "engine-c", clock_c)
        lines = [f"mode {mode}: {workflows} workflows, {writers} writer threads"]
        lost = []
        for wid, token in acked.items():
            stored = c.storage.get(keys.workflow_owner_epoch(wid))
            number, held = decode_epoch(stored), decode_epoch(token)
            if (
                number is None
                or held is None
                or number < held
                or (number == held and stored != token)
            ):
                lost.append(wid)
        total = sum(decode_epoch(t) or 0 for t in acked.values())
        lines.append(
            f"  epochs acknowledged to A before the kill: {total} (the last of each workflow "
            f"counted); workflows whose acknowledged epoch the promoted standby lacks: {len(lost)}"
        )
        if mode == "async":
            reminted = 0
            for wid in ids:
                taken = c.registry.takeover(wid)
                if taken.epoch is not None and taken.epoch <= (decode_epoch(acked[wid]) or 0):
                    reminted += 1
            lines.append(
                f"  epoch numbers handed out a second time by the promoted standby: {reminted} "
                f"(replicated before the lag: {sum(replicated.values())} epochs)"
            )
        pair.move_vip()
        time.sleep(run_s)  # A's writers now reach the new primary
        stop.set()
        for t in threads:
            t.join(30)
        with load.lock:
            before = {token for at, token in load.minted if at <= promoted_at}
            before.update(token for token in acked.values())
            after = [token for at, token in load.accepted_at if at > promoted_at]
        stale = [token for token in after if token in before]
        lines.append(
            f"  writes of A accepted after the promotion: {len(after)}, of them fenced on a "
            f"token minted before it: {len(stale)}"
            + (" (stale: must be 0)" if mode == "async" else " (its epochs survived)")
            + f"; refused (deposed): {load.refused}"
        )
        return lines
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for own in (a, c):
            if own is not None:
                own.close()
                own.storage.close()
        pair.stop()


def _epochs(pair: ReplicaPair, ids: list[str], *, standby: bool) -> dict[str, int]:
    node = pair.standby if standby else pair.primary
    with open_storage(f"{pair.node_url(node)}&table={TABLE}", read_only=True) as storage:
        return {wid: decode_epoch(storage.get(keys.workflow_owner_epoch(wid))) or 0 for wid in ids}


def _quiet_driver_logs() -> None:
    import logging

    # The killed primary makes the pool log every failed reconnect; the counts are the output.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    logging.getLogger("weft_sync").setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mode", choices=("async", "sync", "both"), default="both")
    parser.add_argument("--workflows", type=int, default=40)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--lag-after", type=float, default=2.0)
    parser.add_argument("--run", type=float, default=3.0)
    args = parser.parse_args()
    _quiet_driver_logs()
    load = os.getloadavg()[0]
    print(f"failover benchmark (load average {load:.2f}, {os.cpu_count()} cpus)")
    for mode in ("async", "sync") if args.mode == "both" else (args.mode,):
        for line in run(mode, args.workflows, args.writers, args.lag_after, args.run):
            print(line)


if __name__ == "__main__":
    main()
