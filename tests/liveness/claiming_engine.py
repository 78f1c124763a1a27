"""A child process running a real engine that holds claims until it is killed.

``python -m tests.liveness.claiming_engine URL ENGINE_ID WORKFLOW_ID...`` opens an
:class:`~weft_sync.Ownership` with background maintenance (a TTL far longer than any test, a
renew interval of one second, so its heartbeat checks its session lock every second), claims
each workflow id, prints ``ready`` and runs until its stdin closes or it is killed.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack

from weft_sync import Ownership, OwnershipOptions

OPTIONS = OwnershipOptions(claim_ttl="900s", claim_renew_interval="1s")


def main(url: str, engine_id: str, workflow_ids: list[str]) -> None:
    with Ownership.open(url, engine_id=engine_id, options=OPTIONS) as own, ExitStack() as held:
        for wid in workflow_ids:
            held.enter_context(own.claim(wid))
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        sys.stdin.read()  # until the test closes our stdin (or kills us)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
