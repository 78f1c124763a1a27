"""Takeover latency after SIGKILL: from the owner's death to the survivor driving its workflows.

An owner process (spawned) holds N claims on running workflows (500; ``--quick``: 100) with
interval renewal; a survivor engine in this process runs its own interval task. Once the survivor
has seen the owner's live claims for a while, the owner gets SIGKILL. The survivor's
``on_workflow_claim_reclaimed`` callback stamps each workflow it takes over; the table gives the
first and the last stamp after the kill, median and max over the runs (5; ``--quick``: 2),
against the bound ``TTL + 2 x renew interval + one interval`` (the owner's last holder expires at
most one TTL after the kill, becomes stealable two renew intervals later, and the survivor's
reclaim slot ticks once per interval). Short settings: TTL 900 ms, renew interval 300 ms. The
last stamp also includes the time the survivor's reclaim pass takes for N per-claim CASes.

    python bench/takeover_latency.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--claims N]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Site,
    StoreSpec,
    bench_site,
    hold_claims,
    machine_note,
    parse_args,
    print_table,
    running_workflow_ops,
    selected_backends,
    workflow_ids,
    write_in_chunks,
)
from weft_sync.clock import system_clock
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.storage import open_storage

TTL_MS = 900
RENEW_MS = 300
BOUND_S = (TTL_MS + 2 * RENEW_MS + RENEW_MS) / 1000
OBSERVE_S = 1.0
GIVE_UP_S = 20.0


def _owner_main(url: str, ids: list[str], ready: Any) -> None:
    """Hold a claim on every id with interval renewal, signal ``ready``, idle until killed."""
    storage = open_storage(url)
    ownership = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=system_clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        engine_id="owner",
    )
    hold_claims(ownership.registry, storage, ids, ttl_ms=TTL_MS)
    ownership.renewal_task.start()
    ready.set()
    while True:
        time.sleep(60)


class DriveStamps:
    """The survivor's drive callback: the monotonic time each workflow was first driven."""

    def __init__(self, expected: int) -> None:
        # _lock guards stamps.
        self._lock = threading.Lock()
        self.stamps: dict[str, float] = {}
        self.expected = expected
        self.all_driven = threading.Event()

    def __call__(self, workflow_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.stamps.setdefault(workflow_id, now)
            if len(self.stamps) >= self.expected:
                self.all_driven.set()


def one_run(spec: StoreSpec, claims: int) -> tuple[float, float]:
    """Kill an owner of ``claims`` claims; return (first, last) takeover latency in seconds."""
    ids = workflow_ids(claims)
    with contextlib.closing(spec.open()) as storage:
        now = system_clock()
        write_in_chunks(storage, [op for wid in ids for op in running_workflow_ops(wid, now)])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    owner = ctx.Process(target=_owner_main, args=(spec.url, ids, ready), name="bench-owner")
    owner.start()
    try:
        if not ready.wait(120):
            raise SystemExit("the owner process did not start")
        stamps = DriveStamps(claims)
        with contextlib.closing(spec.open()) as storage:
            survivor = bootstrap_workflow_lease_ownership(
                storage=storage,
                clock=system_clock,
                claim_ttl_ms=TTL_MS,
                claim_renew_interval_ms=RENEW_MS,
                engine_id="survivor",
                on_workflow_claim_reclaimed=stamps,
            )
            survivor.renewal_task.start()
            try:
                time.sleep(OBSERVE_S)
                if stamps.stamps:
                    raise SystemExit("the survivor took over live claims: the owner is too slow")
                killed_at = time.monotonic()
                os.kill(owner.pid or 0, signal.SIGKILL)
                if not stamps.all_driven.wait(GIVE_UP_S):
                    raise SystemExit(
                        f"only {len(stamps.stamps)} of {claims} claims were taken over "
                        f"{GIVE_UP_S} s after the kill"
                    )
            finally:
                survivor.renewal_task.close(timeout=30)
    finally:
        if owner.is_alive():
            os.kill(owner.pid or 0, signal.SIGKILL)
        owner.join(timeout=30)
    times = sorted(stamps.stamps.values())
    return times[0] - killed_at, times[-1] - killed_at


def bench_backend(site: Site, backend: str, claims: int, runs: int) -> None:
    firsts, lasts = [], []
    for _ in range(runs):
        first, last = one_run(site.new_store(backend, name="takeover"), claims)
        firsts.append(first)
        lasts.append(last)

    def row(name: str, values: list[float]) -> list[str]:
        worst = max(values)
        return [
            name,
            f"{statistics.median(values) * 1000:,.0f} ms",
            f"{worst * 1000:,.0f} ms",
            f"{BOUND_S * 1000:,.0f} ms",
            "within" if worst <= BOUND_S else f"+{(worst - BOUND_S) * 1000:,.0f} ms",
        ]

    print_table(
        f"{backend}: takeover after SIGKILL of an owner holding {claims:,} claims "
        f"(TTL {TTL_MS} ms, renew {RENEW_MS} ms, {runs} runs)",
        ["measured from the kill", "median", "max", "bound", "max vs bound"],
        [row("first claim driven", firsts), row(f"all {claims:,} driven", lasts)],
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=None, help="claims the owner holds")


def main() -> None:
    args = parse_args(__doc__, configure)
    claims = args.claims or (100 if args.quick else 500)
    runs = args.repeats or (2 if args.quick else 5)
    print(f"takeover latency benchmark; {machine_note()}")
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            bench_backend(site, backend, claims, runs)


if __name__ == "__main__":
    main()
