"""Clock skew across processes on PostgreSQL: takeovers of live claims, store time vs local time.

Three engine processes (spawned) share one PostgreSQL table for ``--seconds`` of real time (60;
``--quick``: 15). Their host clocks are the wall clock shifted by 0, +``--skew`` and -``--skew``
seconds (20 s), passed as ``clock=``. Each starts ``--claims`` workflows (10) and keeps them with
interval maintenance (TTL 3 s, renew interval 1 s), its main thread driving them (a ``drive()``
block each) and every workflow it takes over (``on_reclaimed`` hands it the id); all three stay
alive and renewing, so every takeover is a takeover of a live claim. The run is made once with
``time_source="store"`` (claim expiry written and judged on the database's clock) and once with
``time_source="local"`` (each host's own clock), and the table prints the takeovers and lost claims
of each, and the share of the started claims still held by the engine that started them at the end.

    python bench/skew.py [--quick] [--seconds N] [--skew S] [--claims N]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_site, enter_drive, machine_note, print_table

TTL_MS = 3_000
RENEW_MS = 1_000


def _engine(
    url: str, skew_ms: int, time_source: str, claims: int, seconds: float, out: Any
) -> None:
    import logging

    from weft_sync import keys
    from weft_sync.clock import system_clock
    from weft_sync.codec import decode_holder
    from weft_sync.options import OwnershipOptions
    from weft_sync.ownership.facade import Ownership

    options = OwnershipOptions(
        claim_ttl=TTL_MS,
        claim_renew_interval=RENEW_MS,
        time_source=time_source,  # type: ignore[arg-type]
    )
    # The lost-claim warnings of the local run are what the table counts, not output.
    logging.getLogger("weft_sync").setLevel(logging.ERROR)
    lost: list[str] = []
    taken: queue.Queue[str] = queue.Queue()
    own = Ownership.open(
        url,
        options=options,
        clock=lambda: system_clock() + skew_ms,
        on_reclaimed=taken.put,  # the main thread drives what this engine took over
        warn=lambda warning: None,
    )
    own.on_lost(lost.append)
    ids = [f"{time_source}-{skew_ms}-{i}" for i in range(claims)]
    # Closed after the engine: its drives end with no claim left.
    with contextlib.ExitStack() as drives:
        for wid in ids:
            own.workflows.start(wid, "job")
            drives.enter_context(own.workflows.drive(wid))
        pending: list[str] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                pending.append(taken.get(timeout=0.05))
            pending = [wid for wid in pending if not enter_drive(own, drives, wid)]
        kept = 0
        for wid in ids:
            holder = decode_holder(own.storage.get(keys.workflow_owner_holder(wid)))
            kept += holder is not None and holder.engine_id == own.engine_id
        snapshot = own.metrics.snapshot()
        own.close()
    out.put((skew_ms, snapshot.attempts["takeover"], len(lost), kept))


def _run(url: str, time_source: str, args: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    skew_ms = int(args.skew * 1000)
    procs = [
        ctx.Process(
            target=_engine,
            args=(url, skew, time_source, args.claims, args.seconds, out),
            name=f"skew-engine{skew:+d}",
        )
        for skew in (0, skew_ms, -skew_ms)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=args.seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    return sorted(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 s per run instead of 60 s")
    parser.add_argument("--seconds", type=float, default=None, help="real seconds per run")
    parser.add_argument("--skew", type=float, default=20.0, help="host clock skew, seconds")
    parser.add_argument("--claims", type=int, default=10, help="workflows per engine")
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 15.0 if args.quick else 60.0
    print(f"clock skew benchmark; {machine_note()}")
    print(
        f"3 engine processes, clocks 0 / +{args.skew:g} s / -{args.skew:g} s, {args.claims} "
        f"claims each, TTL {TTL_MS} ms, renew {RENEW_MS} ms, {args.seconds:g} s per run\n"
    )
    rows = []
    with bench_site(("postgres",)) as site:
        for time_source in ("store", "local"):
            spec = site.new_store("postgres", f"skew-{time_source}")
            results = _run(spec.url, time_source, args)
            takeovers = sum(r[1] for r in results)
            lost = sum(r[2] for r in results)
            kept = sum(r[3] for r in results)
            started = 3 * args.claims
            rows.append(
                [
                    time_source,
                    takeovers,
                    lost,
                    f"{kept}/{started}",
                    f"{kept / started:.2f}",
                    ", ".join(f"{r[0] // 1000:+d}s: {r[1]}" for r in results),
                ]
            )
    print_table(
        "takeovers of live claims",
        ["time_source", "takeovers", "lost", "kept", "kept share", "takeovers per engine"],
        rows,
    )


if __name__ == "__main__":
    main()
