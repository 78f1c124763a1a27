"""A command-line worker: claims work items from a shared store, does fenced work, completes them.

Each work item is a weft_sync workflow of type ``work-item``. Any number of copies may run at
once, on one host (SQLite) or many (PostgreSQL). A copy lists the running items and, for each,
tries ``ownership.claim(item)``: only one copy can hold an item. Under the claim it re-reads the
item, because another copy may have finished it between the listing and the claim; then it
writes each step as a fenced checkpoint (refused by the store if the claim was lost) and
completes the item. Every item is processed by exactly one copy::

    python examples/cli_worker.py --url sqlite:///items.db seed 20
    python examples/cli_worker.py --url sqlite:///items.db work --name a &
    python examples/cli_worker.py --url sqlite:///items.db work --name b &

A worker exits 0 once no item is left running. Its background maintenance only renews its own
claims (it reclaims nothing), so the items of a worker that died stay claimed until a maintenance
process takes them over (``weft-sync maintain``, or see cron_maintenance.py).

Without a subcommand it runs the whole thing in a temporary SQLite store (or ``--url``): seeds 8
items, runs two worker copies as subprocesses and checks that each item was processed once::

    python examples/cli_worker.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from weft_sync import (
    EngineDeposedError,
    Ownership,
    WorkflowClaimLostError,
    WorkflowClaimUnavailableError,
)

ITEM_TYPE = "work-item"


def seed(url: str, count: int, steps: int, out: TextIO) -> int:
    """Create ``count`` running items of ``steps`` steps each, then let go of them."""
    with Ownership.open(url, background="manual") as ownership:
        for number in range(count):
            ownership.workflows.start(f"item-{number:03d}", ITEM_TYPE, input={"steps": steps})
    # Closing released the claims that start() took: the items are free for any worker.
    out.write(f"seeded {count} items\n")
    return 0


def process_if_free(ownership: Ownership, item_id: str, name: str, step_s: float) -> bool:
    """Process ``item_id`` if no other worker holds or has finished it; return whether it did."""
    workflows = ownership.workflows
    try:
        with ownership.claim(item_id) as claim:
            record = workflows.get(item_id)
            if record is None or record.status != "running":
                return False  # finished by another worker after we listed it
            steps = int(record.input.get("steps", 1)) if isinstance(record.input, dict) else 1
            for step in range(1, steps + 1):
                claim.assert_held()
                time.sleep(step_s)  # the work of one step
                workflows.save_checkpoint(item_id, f"{step}/{steps} by {name}".encode())
            workflows.complete(item_id, result={"worker": name})
    except WorkflowClaimUnavailableError:
        return False  # another worker holds it
    except (EngineDeposedError, WorkflowClaimLostError):
        print(f"{name} lost {item_id} to another process; leaving it", file=sys.stderr)
        return False
    print(f"{name} processed {item_id}", flush=True)
    return True


def work(url: str, name: str, step_s: float, idle_timeout_s: float) -> int:
    """Process items until none is left running; 1 if the rest stay held by others too long."""
    processed = 0
    with Ownership.open(url, is_eligible=lambda workflow_type, revision: False) as ownership:
        idle_since = time.monotonic()
        while True:
            pending = [
                record.workflow_id
                for record in ownership.workflows.list(status="running")
                if record.type == ITEM_TYPE
            ]
            if not pending:
                break
            done = sum(process_if_free(ownership, item, name, step_s) for item in pending)
            processed += done
            if done:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_timeout_s:
                print(
                    f"{name}: {len(pending)} items stay held elsewhere; giving up", file=sys.stderr
                )
                return 1
            else:
                time.sleep(0.05)  # the rest are held by other workers right now
    print(f"{name}: no items left; processed {processed}", flush=True)
    return 0


def run_demo(url: str, out: TextIO) -> int:
    """Seed 8 items, run two worker subprocesses over them, check each item was done once."""
    seed(url, 8, steps=3, out=out)
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--url", url, "work", "--name", f"worker-{n}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    ]
    lines = [line for proc in workers for line in proc.communicate()[0].splitlines()]
    if any(proc.returncode != 0 for proc in workers):
        out.write("a worker failed\n")
        return 1
    processed = sorted(line.split()[-1] for line in lines if " processed item-" in line)
    with Ownership.open(url, background="manual") as ownership:
        items = [r for r in ownership.workflows.list() if r.type == ITEM_TYPE]
    all_done = all(r.status == "completed" for r in items)
    exactly_once = processed == sorted(r.workflow_id for r in items)
    for name in ("worker-1", "worker-2"):
        count = sum(line.startswith(name + " processed") for line in lines)
        out.write(f"{name} processed {count} items\n")
    out.write(f"{len(items)} items, all completed: {all_done}, each exactly once: {exactly_once}\n")
    return 0 if all_done and exactly_once else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Claim work items from a shared weft_sync store and process them."
    )
    parser.add_argument("--url", help="store URL (default: a SQLite file in a temporary dir)")
    sub = parser.add_subparsers(dest="command")
    seed_cmd = sub.add_parser("seed", help="create running work items")
    seed_cmd.add_argument("count", type=int)
    seed_cmd.add_argument("--steps", type=int, default=3, help="steps per item (default 3)")
    work_cmd = sub.add_parser("work", help="process items until none is left")
    work_cmd.add_argument("--name", default="worker", help="this worker's name in the output")
    work_cmd.add_argument("--step-ms", type=int, default=10, help="time one step takes")
    work_cmd.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds to wait on items held elsewhere"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weft-worker-") as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'items.db'}"
        if args.command == "seed":
            return seed(url, args.count, args.steps, sys.stdout)
        if args.command == "work":
            return work(url, args.name, args.step_ms / 1000, args.idle_timeout)
        return run_demo(url, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
