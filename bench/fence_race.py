"""Count the orderings of the fence race: a takeover against an open fenced transaction.

Runs ``tests/fencing/race.py`` ``--iterations`` times per backend, with owner A on a thread and
with A in a second process, and prints how often the takeover waited for A's commit, gave up
waiting, or A's commit failed — and how often the forbidden ordering (takeover committed, then
A's write committed) was seen, which must be never.

    python bench/fence_race.py [--iterations 100] [--backend sqlite|postgres]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fencing.hosts import make_env
from tests.fencing.race import race_processes, race_threads
from tests.pgcluster import start_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), action="append")
    args = parser.parse_args()
    for backend in args.backend or ["sqlite", "postgres"]:
        cluster = None
        base = None
        if backend == "postgres":
            base = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN")
            if not base:
                cluster = start_cluster()
                base = cluster.url
        try:
            for runner in (race_threads, race_processes):
                with tempfile.TemporaryDirectory() as tmp:
                    driver = "sqlite3" if backend == "sqlite" else "psycopg"
                    env = make_env(backend, driver, Path(tmp), base)
                    try:
                        counts = runner(env, args.iterations)
                    finally:
                        env.close()
                print(f"{backend:8s} {runner.__name__:14s} {dict(counts)}", flush=True)
        finally:
            if cluster is not None:
                cluster.stop()


if __name__ == "__main__":
    main()
