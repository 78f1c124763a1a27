"""weft_sync.flask: a close that ``Ownership.close()`` refuses (called from an ``on_lost``
callback or a handler: it would wait for itself) leaves the extension holding the still-open
``Ownership``, so a later ``close()``, ``close_all()`` or the exit hook closes it and releases
its claims.

Real Flask app, real SQLite, a real takeover making the claim lost inside a pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask

from weft_sync.clock import ManualClock
from weft_sync.errors import ClosedError
from weft_sync.flask import WeftSync, close_all
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership

TTL_MS = 3_000
RENEW_MS = 1_000


def test_a_close_refused_inside_a_pass_leaves_the_ownership_to_a_later_close(
    tmp_path: Path,
) -> None:
    db = tmp_path / "weft.db"
    app = Flask("review2")
    app.config["WEFT_SYNC_URL"] = f"sqlite:///{db}"
    app.config["WEFT_SYNC_OPTIONS"] = {"claim_ttl": TTL_MS, "claim_renew_interval": RENEW_MS}
    app.config["WEFT_SYNC_BACKGROUND"] = "manual"
    weft = WeftSync(app)
    ownership = weft.get_ownership(app)
    errors: list[BaseException] = []

    @ownership.on_lost
    def shut_down(workflow_id: str) -> None:
        # The host's reaction to losing its leadership claim: stop this app's engine.
        try:
            weft.close(app)
        except BaseException as exc:
            errors.append(exc)
            raise

    thief: Ownership | None = None
    try:
        assert ownership.registry.acquire("leader").status == "acquired"
        # Depose it: another engine takes it over (its clock is past the TTL and grace).
        thief = Ownership.open(
            f"sqlite:///{db}",
            engine_id="engine-b",
            options=OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS),
            clock=ManualClock(10**13),
            background="manual",
        )
        assert thief.registry.takeover("leader").status == "acquired"
        ownership.run_maintenance(wait_handlers=0)  # the renewal finds it lost: on_lost runs
        assert errors and isinstance(errors[0], RuntimeError)  # Ownership.close() refused

        assert not ownership.closed
        assert weft.get_ownership(app) is ownership  # still the extension's ...
        close_all()  # ... so the process-exit hook closes it
        assert ownership.closed
        with pytest.raises(ClosedError):
            weft.get_ownership(app)
    finally:
        if thief is not None:
            thief.close()
        ownership.close()
