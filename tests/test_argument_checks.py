"""``Ownership``'s public entry points refuse bad arguments before anything changes.

``close(timeout)``, ``run_maintenance(wait_handlers)`` and ``claim(wait)`` take seconds: ``None``
or a finite number ``>= 0``; a wrong type is a ``TypeError``, a negative, nan or infinite number a
``ValueError``, and a refused call leaves the engine as it was. ``open(clock=...)`` reads the
clock once and refuses one that does not return ``int`` milliseconds before a store is opened.
Also here: the messages of a handle used after its block ended and of a claim this engine
already holds.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from tests.workflows.helpers import expires_at, holder_engine
from weft_sync.clock import ManualClock, system_clock
from weft_sync.errors import WorkflowClaimLostError, WorkflowClaimUnavailableError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import open_storage

TTL_MS = 3_000
RENEW_MS = 1_000
START_MS = 1_000_000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)

MakeOwnership = Callable[..., Ownership]

WRONG_TYPES = [
    pytest.param(value, id=name)
    for name, value in [
        ("str", "5"),
        ("str-unit", "5s"),
        ("timedelta", datetime.timedelta(seconds=1)),
        ("bool", True),
        ("object", object()),
    ]
]
BAD_NUMBERS = [
    pytest.param(value, id=name)
    for name, value in [
        ("negative-int", -1),
        ("negative-float", -0.5),
        ("nan", math.nan),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("int-past-float", 10**400),
    ]
]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'weft.db'}"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def make_ownership(url: str, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open Ownerships on the test's SQLite store (manual maintenance by default); all closed."""
    opened: list[Ownership] = []

    def make(**kwargs: Any) -> Ownership:
        kwargs.setdefault("options", OPTIONS)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("background", "manual")
        kwargs.setdefault("warn", WarningSink())
        ownership = Ownership.open(url, **kwargs)
        opened.append(ownership)
        return ownership

    yield make
    for ownership in opened:
        ownership.close()


def _engine_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


# -- close(timeout) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "error"),
    [pytest.param(*p.values, TypeError, id=p.id) for p in WRONG_TYPES]
    + [pytest.param(*p.values, ValueError, id=p.id) for p in BAD_NUMBERS],
)
def test_close_with_a_bad_timeout_raises_and_leaves_the_engine_open(
    make_ownership: MakeOwnership, url: str, timeout: object, error: type[Exception]
) -> None:
    before = set(threading.enumerate())
    ownership = make_ownership(background="thread", clock=system_clock)
    ownership.workflows.start("wf-1", "job")
    threads = _engine_threads(before)
    assert threads

    with pytest.raises(error, match=r"close\(\): timeout must be a (finite )?number of seconds"):
        ownership.close(timeout=timeout)  # type: ignore[arg-type]

    assert (ownership.closed, ownership.started) == (False, True)
    assert all(t.is_alive() for t in threads)
    assert holder_engine(ownership.storage, "wf-1") == ownership.engine_id
    with ownership.claim("wf-2") as handle:
        handle.assert_held()

    ownership.close()
    assert ownership.closed
    assert _engine_threads(before) == []
    storage = open_storage(url)
    try:
        assert holder_engine(storage, "wf-1") is None
    finally:
        storage.close()


def test_close_bad_timeout_message_names_the_value(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership()
    with pytest.raises(TypeError, match=r"got str 'x'"):
        ownership.close(timeout="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got -1$"):
        ownership.close(timeout=-1)


@pytest.mark.parametrize("timeout", [None, 0, 0.5, 2])
def test_close_accepts_none_zero_and_positive_timeouts(
    make_ownership: MakeOwnership, timeout: float | None
) -> None:
    ownership = make_ownership()
    ownership.close(timeout=timeout)
    assert ownership.closed


# -- run_maintenance(wait_handlers) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("wait_handlers", "error"),
    [pytest.param(*p.values, TypeError, id=p.id) for p in WRONG_TYPES]
    + [pytest.param(*p.values, ValueError, id=p.id) for p in BAD_NUMBERS],
)
def test_run_maintenance_with_a_bad_wait_handlers_raises_before_any_pass(
    make_ownership: MakeOwnership,
    clock: ManualClock,
    wait_handlers: object,
    error: type[Exception],
) -> None:
    ownership = make_ownership()
    with ownership.claim("wf-1"):
        renewed_until = expires_at(ownership.storage, "wf-1")
        assert renewed_until is not None
        clock.advance(RENEW_MS)
        with pytest.raises(error, match=r"run_maintenance\(\): wait_handlers must be .* got "):
            ownership.run_maintenance(wait_handlers=wait_handlers)  # type: ignore[arg-type]
        # No pass ran, so nothing was renewed.
        assert expires_at(ownership.storage, "wf-1") == renewed_until
        ownership.run_maintenance(wait_handlers=0)
        assert expires_at(ownership.storage, "wf-1") == renewed_until + RENEW_MS


# -- claim(wait) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", WRONG_TYPES)
def test_claim_with_a_wait_of_the_wrong_type_raises_type_error(
    make_ownership: MakeOwnership, wait: object
) -> None:
    ownership = make_ownership()
    with (
        pytest.raises(TypeError, match=r"claim\(\): wait must be a number of seconds .* got "),
        ownership.claim("wf-1", wait=wait),  # type: ignore[arg-type]
    ):
        pass
    assert ownership.registry.list_held_workflow_ids() == []


@pytest.mark.parametrize("wait", BAD_NUMBERS)
def test_claim_with_a_negative_or_infinite_wait_raises_value_error(
    make_ownership: MakeOwnership, wait: float
) -> None:
    ownership = make_ownership()
    with (
        pytest.raises(ValueError, match=r"claim\(\): wait must be a finite number of seconds"),
        ownership.claim("wf-1", wait=wait),
    ):
        pass
    assert ownership.registry.list_held_workflow_ids() == []


def test_claim_wait_message_names_the_value(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership()
    block = ownership.claim("wf-1", wait="5s")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got str '5s'$"):
        block.__enter__()


# -- open(clock) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clock", "returned"),
    [
        (time.time, "float"),
        (lambda: 1_000_000.0, "float"),
        (lambda: True, "bool"),
        (lambda: "1000000", "str"),
        (lambda: None, "NoneType"),
    ],
)
def test_open_refuses_a_clock_that_does_not_return_int_milliseconds(
    tmp_path: Path, clock: Callable[[], object], returned: str
) -> None:
    db = tmp_path / "weft.db"
    before = set(threading.enumerate())
    with pytest.raises(TypeError, match=rf"int milliseconds since the Unix epoch.* {returned} "):
        Ownership.open(f"sqlite:///{db}", clock=clock)  # type: ignore[arg-type]
    assert not db.exists()
    assert _engine_threads(before) == []


def test_open_with_time_time_says_it_returns_seconds(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"time\.time returns float seconds"):
        Ownership.open(f"sqlite:///{tmp_path / 'weft.db'}", clock=time.time)  # type: ignore[arg-type]


def test_open_refuses_a_clock_that_is_not_callable(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"clock must be callable"):
        Ownership.open(f"sqlite:///{tmp_path / 'weft.db'}", clock=1_000_000)  # type: ignore[arg-type]
    assert not (tmp_path / "weft.db").exists()


# -- a handle after its block --------------------------------------------------------------------


def test_assert_held_after_the_block_ended_says_the_claim_was_released(
    make_ownership: MakeOwnership,
) -> None:
    with make_ownership().claim("wf-1") as handle:
        pass
    with pytest.raises(
        WorkflowClaimLostError, match=r"released when its claim\(\) block ended"
    ) as raised:
        handle.assert_held()
    assert raised.value.released
    assert "lost while it was held" not in str(raised.value)
    assert not handle.lost.is_set()


def test_assert_held_after_a_block_that_raised_says_the_claim_was_released(
    make_ownership: MakeOwnership,
) -> None:
    with pytest.raises(KeyError), make_ownership().claim("wf-1") as handle:
        raise KeyError("mine")
    with pytest.raises(WorkflowClaimLostError, match=r"was released"):
        handle.assert_held()


def test_assert_held_on_a_handle_lost_to_close_still_says_lost(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership()
    with pytest.raises(WorkflowClaimLostError), ownership.claim("wf-1") as handle:
        ownership.close()
        with pytest.raises(WorkflowClaimLostError, match=r"was lost while it was held"):
            handle.assert_held()
    with pytest.raises(WorkflowClaimLostError, match=r"was lost while it was held"):
        handle.assert_held()


# -- a claim this engine already holds -----------------------------------------------------------


def test_a_nested_claim_says_this_engine_holds_it(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership()
    with (
        ownership.claim("wf-1"),
        pytest.raises(WorkflowClaimUnavailableError) as refused,
        ownership.claim("wf-1"),
    ):
        pass
    error = refused.value
    assert type(error) is WorkflowClaimUnavailableError
    assert (error.workflow_id, error.held_by) == ("wf-1", ownership.engine_id)
    assert "already held by this engine" in str(error)
    assert ownership.engine_id in str(error)
    assert "retry later" not in str(error)


def test_claiming_a_workflow_this_engine_started_says_this_engine_holds_it(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership()
    ownership.workflows.start("wf-1", "job")
    with (
        pytest.raises(WorkflowClaimUnavailableError, match=r"already held by this engine"),
        ownership.claim("wf-1"),
    ):
        pass


def test_starting_an_id_this_engine_holds_in_a_claim_block_says_this_engine_holds_it(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership()
    with (
        ownership.claim("wf-1"),
        pytest.raises(WorkflowClaimUnavailableError) as refused,
    ):
        ownership.workflows.start("wf-1", "job")
    error = refused.value
    assert (error.workflow_id, error.held_by) == ("wf-1", ownership.engine_id)
    assert "already held by this engine" in str(error)
    assert "retry later" not in str(error)


def test_starting_an_id_another_engine_holds_names_that_holder(
    make_ownership: MakeOwnership,
) -> None:
    holder = make_ownership(engine_id="engine-a")
    other = make_ownership(engine_id="engine-b")
    with holder.claim("wf-1"), pytest.raises(WorkflowClaimUnavailableError) as refused:
        other.workflows.start("wf-1", "job")
    assert refused.value.held_by == "engine-a"
    assert "(currently held by 'engine-a'); retry later" in str(refused.value)


def test_a_claim_held_by_another_engine_still_names_that_holder(
    make_ownership: MakeOwnership,
) -> None:
    holder = make_ownership(engine_id="engine-a")
    other = make_ownership(engine_id="engine-b")
    with (
        holder.claim("wf-1"),
        pytest.raises(WorkflowClaimUnavailableError) as refused,
        other.claim("wf-1"),
    ):
        pass
    assert refused.value.held_by == "engine-a"
    assert "(currently held by 'engine-a'); retry later" in str(refused.value)
    assert "this engine" not in str(refused.value)
