"""Bare-claim takeover after SIGKILL at the default TTL: how long a ``claim(id, wait=...)`` waits.

A holder process opens an ``Ownership`` with the default options (TTL 30 s, renew 5 s,
``background="thread"``) and holds ``claim("nightly")``. The measuring process opens its own
``Ownership`` with the same defaults, lets its crash probe see the holder's engine record (one
probe refresh), starts a waiter thread in ``claim("nightly", wait=60)``, then SIGKILLs the
holder. Measured: from the kill to the waiter's block being entered (``time.monotonic()``, one
clock on the host). Target: at most 250 ms, where waiting out the TTL would take 30 s + the
grace. Checked after each run: the waiter holds epoch 2 (a fenced takeover, not an acquire of a
released claim).

    python bench/bare_claim_takeover.py [--repeats N] [--url URL]

Without ``--url`` each run uses a fresh SQLite file in a temporary directory (with it, a fresh
claim id per run). Prints the median,
the runs, and the load average.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from weft_sync import Ownership  # noqa: E402

TARGET_S = 0.250
HOLDER = """
import sys, time
from weft_sync import Ownership
own = Ownership.open(sys.argv[1])
with own.claim(sys.argv[2]) as handle:
    print("held", handle.epoch, flush=True)
    time.sleep(3600)
"""


def one_run(url: str) -> tuple[float, int]:
    """Seconds from the holder's SIGKILL to the waiter's takeover, and the epoch it took."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    claim_id = f"nightly-{uuid.uuid4().hex[:8]}"  # a fresh id per run, also on a shared store
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, claim_id], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.startswith("held"), line
        with Ownership.open(url) as waiter_side:
            time.sleep(1.5)  # one probe refresh: the holder's engine record is watched now
            taken: dict[str, float | int] = {}
            started = threading.Event()

            def wait_for_claim() -> None:
                started.set()
                with waiter_side.claim(claim_id, wait=60) as handle:
                    taken["at"] = time.monotonic()
                    taken["epoch"] = handle.epoch

            waiter = threading.Thread(target=wait_for_claim, name="bench-waiter")
            waiter.start()
            started.wait()
            time.sleep(0.3)  # the waiter is in its retry loop, refused by the live holder
            killed_at = time.monotonic()
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            waiter.join(70)
            if "at" not in taken:
                raise RuntimeError("the waiter never got the claim")
            return float(taken["at"]) - killed_at, int(taken["epoch"])
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--url", default=None, help="a store URL (default: fresh SQLite files)")
    args = parser.parse_args()
    times: list[float] = []
    for run in range(args.repeats):
        if args.url is None:
            with tempfile.TemporaryDirectory() as tmp:
                seconds, epoch = one_run(f"sqlite:///{tmp}/bench.db")
        else:
            seconds, epoch = one_run(args.url)
        if epoch != 2:
            raise RuntimeError(f"run {run}: the waiter holds epoch {epoch}, expected 2")
        times.append(seconds)
        print(f"run {run + 1}: {seconds * 1000:.0f} ms (epoch {epoch})", flush=True)
    median = statistics.median(times)
    verdict = "meets" if median <= TARGET_S else "MISSES"
    print(
        f"bare-claim takeover after SIGKILL, default TTL 30 s: median {median * 1000:.0f} ms over "
        f"{len(times)} runs ({verdict} the {TARGET_S * 1000:.0f} ms target; waiting out the TTL "
        f"would take >= 30000 ms: ratio {30.0 / median:.0f}x); load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )


if __name__ == "__main__":
    main()
