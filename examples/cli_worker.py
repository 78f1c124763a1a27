"""A command-line worker: drives work items from a shared store through a workflow handler.

Each work item is a weft_sync workflow of type ``work-item``. Any number of copies may run at
once, on one host (SQLite) or many (PostgreSQL). A copy registers one handler for the type and
lets its background maintenance do the rest: every renew interval its reclaim pass claims running
items nobody holds (freshly seeded ones, or those of a worker that died) up to ``--concurrency``
at a time, and calls the handler with a ``ReclaimedWorkflow`` on one of the engine's handler
threads. The handler resumes from the item's checkpoint, writes each step as a fenced
checkpoint (refused by the store if another copy took the item over) and completes the item.
Only one copy holds an item at a time, so every item is completed exactly once::

    python examples/cli_worker.py --url sqlite:///items.db seed 20
    python examples/cli_worker.py --url sqlite:///items.db work --name a &
    python examples/cli_worker.py --url sqlite:///items.db work --name b &

A worker exits 0 once no item is left running, 1 if items stay held by others for longer than
``--idle-timeout``. If a worker is killed mid-item, another running copy sees the crash through
the dead worker's session lock and takes that item over at once; a worker that is frozen
(SIGSTOP) loses its items once their claims expired (TTL plus two renew intervals). The new
owner finishes each item from its checkpoint.

Without a subcommand it runs the whole thing in a temporary SQLite store (or ``--url``): seeds 8
items, runs two worker copies as subprocesses and checks that each item was completed once::

    python examples/cli_worker.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow, WorkflowHandler

ITEM_TYPE = "work-item"

# Handlers run on several handler threads at once; one line is printed at a time.
_print_lock = threading.Lock()


def say(line: str) -> None:
    """Print ``line`` whole, even when other threads print too."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def seed(url: str, count: int, steps: int, out: TextIO) -> int:
    """Create ``count`` running items of ``steps`` steps each, then let go of them."""
    with Ownership.open(url, background="manual") as ownership:
        for number in range(count):
            ownership.workflows.start(f"item-{number:03d}", ITEM_TYPE, input={"steps": steps})
    # Closing released the claims that start() took: the items are free for any worker.
    out.write(f"seeded {count} items\n")
    return 0


def make_handler(name: str, step_s: float) -> WorkflowHandler:
    """The handler of ``work-item``: resume from the checkpoint, one fenced write per step."""

    def process_item(ctx: ReclaimedWorkflow) -> None:
        # Runs on a handler thread of this worker, which holds the item's claim at ctx.epoch.
        item_id, workflows = ctx.workflow_id, ctx.workflows
        job = ctx.record.input if isinstance(ctx.record.input, dict) else {}
        steps = int(job.get("steps", 1))
        checkpoint = workflows.load_checkpoint(item_id)
        done = int(checkpoint.split(b"/")[0]) if checkpoint else 0
        say(f"{name} started {item_id} at step {done + 1}")
        for step in range(done + 1, steps + 1):
            time.sleep(step_s)  # the work of one step
            workflows.save_checkpoint(item_id, f"{step}/{steps} by {name}".encode())
        workflows.complete(item_id, result={"worker": name})
        say(f"{name} processed {item_id}")

    return process_item


def work(
    url: str,
    name: str,
    step_s: float,
    idle_timeout_s: float,
    *,
    concurrency: int = 2,
    options: OwnershipOptions | None = None,
) -> int:
    """Drive items until none is left running; 1 if the rest stay held by others too long."""
    with Ownership.open(
        url,
        options=options,
        handlers={ITEM_TYPE: make_handler(name, step_s)},
        max_claims=concurrency,
    ) as ownership:
        idle_since, left = time.monotonic(), -1
        while True:
            running = [
                record.workflow_id
                for record in ownership.workflows.list(status="running")
                if record.type == ITEM_TYPE
            ]
            if not running:
                break
            if len(running) != left:
                idle_since, left = time.monotonic(), len(running)
            elif time.monotonic() - idle_since > idle_timeout_s:
                print(f"{name}: {left} items stay held elsewhere; giving up", file=sys.stderr)
                return 1
            time.sleep(0.05)
    say(f"{name}: no items left")
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
        description="Drive work items from a shared weft_sync store through a handler."
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
        "--concurrency", type=int, default=2, help="items this worker drives at once (default 2)"
    )
    work_cmd.add_argument("--ttl", default="3s", help="claim TTL (default 3s)")
    work_cmd.add_argument("--renew", default="500ms", help="renew interval (default 500ms)")
    work_cmd.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds to wait on items held elsewhere"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="weft-worker-") as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'items.db'}"
        if args.command == "seed":
            return seed(url, args.count, args.steps, sys.stdout)
        if args.command == "work":
            options = OwnershipOptions(claim_ttl=args.ttl, claim_renew_interval=args.renew)
            return work(
                url,
                args.name,
                args.step_ms / 1000,
                args.idle_timeout,
                concurrency=args.concurrency,
                options=options,
            )
        return run_demo(url, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
