"""The long run of the fenced host-table contention: N processes x M workflows under signals.

Each process appends ``epoch:engine:seq`` to its workflows' rows in a host table through
``Ownership.fenced`` while the driver SIGSTOPs, SIGCONTs and SIGKILLs them (see
``tests/fencing/host_contention.py``); afterwards every history must have non-decreasing epochs
and one writer per epoch. Prints the counts of one run per backend.

    python bench/fenced_contention.py [--processes 4] [--workflows 100] [--seconds 60]
        [--backend sqlite|postgres]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fencing.host_contention import run_contention
from tests.pgcluster import start_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--workflows", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), action="append")
    args = parser.parse_args()
    for backend in args.backend or ["sqlite", "postgres"]:
        with tempfile.TemporaryDirectory() as tmp:
            table = "t_" + uuid.uuid4().hex[:16]
            cluster = None
            if backend == "sqlite":
                db_url = os.path.join(tmp, "shared.db")
                storage_url = f"sqlite:///{db_url}?table={table}"
            else:
                db_url = os.environ.get("WEFT_SYNC_TEST_POSTGRES_DSN") or ""
                if not db_url:
                    cluster = start_cluster()
                    db_url = cluster.url
                storage_url = f"{db_url}{'&' if '?' in db_url else '?'}table={table}"
            try:
                result = run_contention(
                    backend=backend,
                    storage_url=storage_url,
                    db_url=db_url,
                    tmp_path=Path(tmp),
                    processes=args.processes,
                    workflows=args.workflows,
                    duration_s=args.seconds,
                )
            finally:
                if cluster is not None:
                    cluster.stop()
        print(
            f"{backend}: histories OK: {result.entries} entries, {result.handed_over} workflows "
            f"written under several epochs; signals {dict(result.signals)}; "
            f"contender counts {dict(sorted(result.counts.items()))}"
        )


if __name__ == "__main__":
    main()
