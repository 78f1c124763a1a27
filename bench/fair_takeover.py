"""Fair takeover: how a dead engine's workflows are shared among survivor processes.

An owner process starts N running workflows (300; ``--quick``: 150) of type ``job`` with
interval renewal and drives them (a ``drive()`` block each). Three survivor processes each open
an ``Ownership`` with a handler for ``job`` (it writes a fenced checkpoint and hands the workflow
to the survivor's main thread, which keeps driving it, as a long-running job would) and hold and
drive a few workflows of their own (5 each). Once every process runs, the owner gets SIGKILL; the
table gives, per run, how many of the N workflows each survivor's handler drove, its share, the
time from the kill to the last takeover, and whether every workflow was driven exactly once.
Target: each survivor between 20 % and 50 %.

A second scenario repeats it with survivors that hold nothing of their own (``--idle`` rows):
they count in the split through their engine records (a holder scan alone could not see them).
Short settings: TTL 1,500 ms, renew interval 500 ms.

    python bench/fair_takeover.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--workflows N] [--log-dir DIR]

``--log-dir`` writes each survivor's reclaim decisions (DEBUG) to ``DIR/<survivor>.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Site,
    StoreSpec,
    bench_site,
    enter_drive,
    machine_note,
    parse_args,
    print_table,
    selected_backends,
)
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow

TTL_MS = 1_500
RENEW_MS = 500
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
SURVIVORS = ("survivor-1", "survivor-2", "survivor-3")
OWN_WORK = 5
OBSERVE_S = 1.0
GIVE_UP_S = 30.0
START_S = 120.0


def _owner_main(url: str, count: int, ready: Any) -> None:
    """Start and drive ``count`` running ``job`` workflows, signal ``ready``, idle till killed.

    The main thread drives every workflow (one ``drive()`` block each, left open): a claim
    held with nobody driving it would be released one renew interval after its start.
    """
    ownership = Ownership.open(url, options=OPTIONS, engine_id="owner")
    with contextlib.ExitStack() as drives:
        for n in range(count):
            wid = f"job-{n:04d}"
            ownership.workflows.start(wid, "job")
            drives.enter_context(ownership.workflows.drive(wid))
        ready.set()
        while True:
            time.sleep(60)


def _survivor_main(
    url: str, name: str, own: int, ready: Any, stop: Any, driven: Any, log_dir: str | None
) -> None:
    """Drive reclaimed ``job`` workflows (reporting each on ``driven``) until ``stop`` is set.

    The handler hands each workflow to the main thread, which drives it from then on (a
    ``drive()`` block each, as for the survivor's own workflows): a handler that returns without
    finishing leaves its claim to be released one renew interval later.
    """
    if log_dir is not None:
        logging.basicConfig(
            filename=str(Path(log_dir) / f"{name}.log"),
            format="%(created).3f %(threadName)s %(name)s %(levelname)s %(message)s",
            level=logging.WARNING,
        )
        logging.getLogger("weft_sync.reclaim.target").setLevel(logging.DEBUG)

    handed: queue.Queue[str] = queue.Queue()

    def resume(ctx: ReclaimedWorkflow) -> None:
        ctx.workflows.save_checkpoint(ctx.workflow_id, f"resumed by {name}".encode())
        driven.put((name, ctx.workflow_id, time.monotonic()))
        handed.put(ctx.workflow_id)

    # The drives are entered before the engine opens, so they end after its close released the
    # claims: none is left unfinished.
    with (
        contextlib.ExitStack() as drives,
        Ownership.open(url, options=OPTIONS, engine_id=name, handlers={"job": resume}) as own_it,
    ):
        for n in range(own):
            wid = f"{name}-own-{n}"
            own_it.workflows.start(wid, "own")
            drives.enter_context(own_it.workflows.drive(wid))
        ready.set()
        deadline = time.monotonic() + START_S + GIVE_UP_S
        pending: list[str] = []
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                pending.append(handed.get(timeout=0.05))
            pending = [wid for wid in pending if not enter_drive(own_it, drives, wid)]


def one_run(spec: StoreSpec, count: int, own: int, log_dir: str | None) -> dict[str, Any]:
    """Kill an owner of ``count`` workflows among three survivors; return who drove what."""
    ctx = multiprocessing.get_context("spawn")
    owner_ready, stop = ctx.Event(), ctx.Event()
    driven: Any = ctx.Queue()
    owner = ctx.Process(target=_owner_main, args=(spec.url, count, owner_ready), name="owner")
    owner.start()
    survivors: list[Any] = []
    try:
        if not owner_ready.wait(START_S):
            raise SystemExit("the owner process did not start")
        readies = []
        for name in SURVIVORS:
            ready = ctx.Event()
            proc = ctx.Process(
                target=_survivor_main,
                args=(spec.url, name, own, ready, stop, driven, log_dir),
                name=name,
            )
            proc.start()
            survivors.append(proc)
            readies.append(ready)
        if not all(ready.wait(START_S) for ready in readies):
            raise SystemExit("a survivor process did not start")
        time.sleep(OBSERVE_S)
        if not driven.empty():
            raise SystemExit("a survivor took over live claims: the owner is too slow")
        killed_at = time.monotonic()
        os.kill(owner.pid or 0, signal.SIGKILL)
        events = _collect(driven, count)
    finally:
        stop.set()
        if owner.is_alive():
            os.kill(owner.pid or 0, signal.SIGKILL)
        owner.join(30)
        for proc in survivors:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(30)
    per_workflow = Counter(wid for _, wid, _ in events)
    return {
        "shares": Counter(name for name, _, _ in events),
        "driven": len(per_workflow),
        "twice": sum(1 for n in per_workflow.values() if n > 1),
        "last_s": max((at for _, _, at in events), default=killed_at) - killed_at,
    }


def _collect(driven: Any, count: int) -> list[tuple[str, str, float]]:
    events: list[tuple[str, str, float]] = []
    seen: set[str] = set()
    deadline = time.monotonic() + GIVE_UP_S
    while len(seen) < count and time.monotonic() < deadline:
        try:
            event = driven.get(timeout=0.2)
        except queue.Empty:
            continue
        events.append(event)
        seen.add(event[1])
    # A second drive of a workflow would arrive within a pass or two; wait for one.
    time.sleep(2 * RENEW_MS / 1000)
    while True:
        try:
            events.append(driven.get_nowait())
        except queue.Empty:
            return events


def bench_backend(
    site: Site, backend: str, count: int, runs: int, log_dir: str | None = None
) -> None:
    rows = []
    for label, own in (("own work", OWN_WORK), ("--idle", 0)):
        for run in range(1, runs + 1):
            result = one_run(site.new_store(backend, name="fair"), count, own, log_dir)
            shares = [result["shares"].get(name, 0) for name in SURVIVORS]
            within = all(0.2 <= n / count <= 0.5 for n in shares)
            rows.append(
                [
                    f"{label}, run {run}",
                    *(f"{n} ({n / count:.0%})" for n in shares),
                    f"{result['driven']}/{count}",
                    str(result["twice"]),
                    f"{result['last_s'] * 1000:,.0f} ms",
                    "yes" if within else "no",
                ]
            )
    print_table(
        f"{backend}: {count} workflows of a SIGKILLed owner, 3 survivor processes "
        f"(TTL {TTL_MS} ms, renew {RENEW_MS} ms)",
        ["scenario", *SURVIVORS, "driven", "twice", "last takeover", "all in 20-50 %"],
        rows,
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workflows", type=int, default=None, help="workflows the owner holds")
    parser.add_argument("--log-dir", default=None, help="write survivors' reclaim decisions here")


def main() -> None:
    args = parse_args(__doc__, configure)
    count = args.workflows or (150 if args.quick else 300)
    runs = args.repeats or (1 if args.quick else 3)
    print(f"fair takeover benchmark; {machine_note()}")
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            bench_backend(site, backend, count, runs, args.log_dir)


if __name__ == "__main__":
    main()
