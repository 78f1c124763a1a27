"""A bare ``claim(id, wait=...)`` waiter takes the claim of a crashed holder at once.

The holder's engine is a real process (``tests.liveness.holder``: its session lock and engine
record) that is SIGKILLed; the bare claim it holds was written under its engine id. The TTL is
far longer than the test, so only the crash probe can explain the takeover. (How fast is
measured by ``bench/bare_claim_takeover.py``, never asserted here.)
"""

from __future__ import annotations

import threading

from tests.claims.gated import WarningSink
from tests.liveness.procs import WAIT_S, holding
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import Ownership, OwnershipOptions
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import system_clock
from weft_sync.storage import Storage

OPTIONS = OwnershipOptions(claim_ttl="900s", claim_renew_interval="300s")


def test_a_waiter_takes_over_a_bare_claim_whose_engine_crashed(
    storage: Storage, storage_url: str
) -> None:
    with holding(storage_url, "engine-k", "engine") as child:
        crashed = ClaimRegistry(
            storage,
            engine_id="engine-k",
            clock=system_clock,
            claim_ttl_ms=900_000,
            claim_renew_interval_ms=300_000,
            warn=WarningSink(),
        )
        assert crashed.acquire("nightly").status == "acquired"
        with Ownership.open(storage, engine_id="engine-w", options=OPTIONS) as waiter_side:
            refused = threading.Event()
            epochs: list[int] = []

            def wait() -> None:
                with waiter_side.claim("nightly", wait=WAIT_S) as handle:
                    epochs.append(handle.epoch)

            waiter = threading.Thread(target=wait, name="claim-waiter")
            waiter.start()
            # The live holder refuses the waiter for now.
            refused.wait(0.3)
            assert epochs == []
            child.proc.kill()
            child.proc.wait()
            waiter.join(WAIT_S)
            assert not waiter.is_alive()
            assert epochs == [2]
            assert holder_engine(storage, "nightly") is None  # released at the block's end
            assert stored_epoch(storage, "nightly") == 2
        crashed.close()
