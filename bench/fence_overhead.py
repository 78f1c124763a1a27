"""Time the fence's own work: an empty fenced block against the same statements by hand.

On SQLite an empty block commits nothing, so no disk wait hides the Python side: ``fenced`` is
``with ownership.fenced(workflow_id, connection): pass``, ``hand-written`` is ``BEGIN IMMEDIATE``,
the epoch read and ``COMMIT`` on the same connection. Prints the best and the median
per-block time of each over ``--rounds`` rounds of ``--ops`` blocks (the ways taking turns each
round) and the difference, the fence's own cost per block, measured in this run.

    python bench/fence_overhead.py [--ops 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weft_sync import Ownership, keys

WID = "bench-fence-overhead"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        with Ownership.open(f"sqlite:///{path}", background="manual") as own:
            conn = sqlite3.connect(path, isolation_level=None)
            own.registry.acquire(WID)
            epoch_key = keys.workflow_owner_epoch(WID)

            def fenced() -> None:
                with own.fenced(WID, conn):
                    pass

            def hand() -> None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("SELECT value FROM weft_kv WHERE key = ?", (epoch_key,)).fetchall()
                conn.execute("COMMIT")

            ways = {"fenced": fenced, "hand-written": hand}
            samples: dict[str, list[float]] = {name: [] for name in ways}
            for way in ways.values():
                way()  # warm up: the same-database proof, statement caches
            for _ in range(args.rounds):
                for name, way in ways.items():
                    samples[name].append(timeit.timeit(way, number=args.ops) / args.ops)
            conn.close()
    best = {name: min(times) * 1e6 for name, times in samples.items()}
    median = {name: statistics.median(times) * 1e6 for name, times in samples.items()}
    for name in ways:
        print(f"{name:13s} best {best[name]:6.1f} us  median {median[name]:6.1f} us")
    print(
        f"the fence's own work per block: best {best['fenced'] - best['hand-written']:.1f} us, "
        f"median {median['fenced'] - median['hand-written']:.1f} us"
    )


if __name__ == "__main__":
    main()
