"""No claim survives ``Ownership.close()``: operations racing it finish before it or raise.

Threads call ``workflows.start()``, ``claim()``, ``registry.acquire()`` and ``workflows.resume()``
in a loop while the maintenance thread reclaims a dead engine's workflows and the main thread
calls ``close()``. Every call either returns before ``close()`` released everything (its claim
is then released by ``close()``) or raises ``ClosedError``; afterwards the store holds no holder
record of the closed engine. Repeated for several rounds on both backends.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable

import pytest

from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder
from weft_sync.errors import ClosedError, WorkflowClaimLostError, WorkflowClaimUnavailableError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

ROUNDS = 20
CALLERS_PER_KIND = 2
DEAD_WORKFLOWS = 30
FAST = OwnershipOptions(claim_ttl=600, claim_renew_interval=200)
JOIN_S = 30.0


def _holders_of(storage: Storage, engine_id: str) -> list[str]:
    prefix = keys.workflow_owner_holder("")
    return [
        key
        for key, value in storage.scan(prefix)
        if (holder := decode_holder(value)) is not None and holder.engine_id == engine_id
    ]


class _Caller:
    """Calls one operation in a loop until it raises ``ClosedError``; keeps any other error."""

    def __init__(self, name: str, call: Callable[[int], object], started: threading.Event) -> None:
        self.successes = 0
        self.unexpected: BaseException | None = None
        self._call = call
        self._started = started
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        for n in itertools.count():
            try:
                self._call(n)
            except ClosedError:
                return
            except WorkflowClaimLostError:
                # A claim() block that close() marked lost while it was held.
                self.successes += 1
            except BaseException as exc:
                self.unexpected = exc
                return
            else:
                self.successes += 1
            if self.successes >= 3:
                self._started.set()


def _seed_dead_engine(storage: Storage, round_no: int) -> list[str]:
    """Workflows started by an engine whose clock is far behind: their claims look expired."""
    dead = Ownership.open(storage, options=FAST, clock=ManualClock(1_000_000), background="manual")
    ids = [f"dead-{round_no}-{i}" for i in range(DEAD_WORKFLOWS)]
    for wid in ids:
        dead.workflows.start(wid, "job")
    # Forget the claims without releasing them: the engine "died".
    for wid in ids:
        dead.registry.forget_local_claim(wid)
    dead.close()
    return ids


def _round(storage: Storage, round_no: int) -> None:
    dead_ids = _seed_dead_engine(storage, round_no)
    own = Ownership.open(
        storage,
        options=FAST,
        clock=ManualClock(10**12),
        on_reclaimed=lambda wid: None,
        warn=lambda warning: None,
    )
    engine_id = own.engine_id
    started = threading.Event()
    resumable = iter(dead_ids)

    def start(n: int) -> None:
        own.workflows.start(f"s-{round_no}-{threading.get_ident()}-{n}", "job")

    def claim(n: int) -> None:
        with own.claim(f"c-{round_no}-{threading.get_ident()}-{n}"):
            pass

    def acquire(n: int) -> None:
        own.registry.acquire(f"a-{round_no}-{threading.get_ident()}-{n}")

    def resume(n: int) -> None:
        wid = next(resumable, None)
        if wid is None:
            own.workflows.start(f"r-{round_no}-{threading.get_ident()}-{n}", "job")
            return
        # The reclaim pass may have taken it over first.
        with contextlib.suppress(WorkflowClaimUnavailableError):
            own.workflows.resume(wid)

    callers = [
        _Caller(f"close-race-{fn.__name__}-{i}", fn, started)
        for fn in (start, claim, acquire, resume)
        for i in range(CALLERS_PER_KIND)
    ]
    for caller in callers:
        caller.thread.start()
    try:
        assert started.wait(JOIN_S), "no operation succeeded before close()"
    finally:
        own.close()
        for caller in callers:
            caller.thread.join(JOIN_S)
    assert not any(c.thread.is_alive() for c in callers)
    for caller in callers:
        if caller.unexpected is not None:
            raise caller.unexpected
    assert sum(c.successes for c in callers) > 0
    leaked = _holders_of(storage, engine_id)
    assert leaked == [], f"round {round_no}: {len(leaked)} holders left after close(): {leaked}"


@pytest.mark.parametrize("rounds", [ROUNDS])
def test_no_claim_survives_close_racing_start_claim_resume_and_reclaim(
    storage: Storage, rounds: int
) -> None:
    for round_no in range(rounds):
        _round(storage, round_no)


def test_an_operation_after_close_raises_closed_error_and_writes_nothing(
    storage: Storage,
) -> None:
    own = Ownership.open(storage, options=FAST, background="manual")
    engine_id = own.engine_id
    own.close()
    with pytest.raises(ClosedError):
        own.registry.acquire("late-1")
    with pytest.raises(ClosedError):
        own.registry.takeover("late-2")
    with pytest.raises(ClosedError):
        own.workflows.start("late-3", "job")
    assert _holders_of(storage, engine_id) == []
    assert storage.get(keys.workflow("late-3")) is None
