"""The race that matters: no takeover commits between the fence check and the host's commit."""

from __future__ import annotations

import pytest

from tests.fencing.hosts import HostEnv
from tests.fencing.race import TIMED_OUT, VIOLATION, WAITED, race_processes, race_threads

ITERATIONS = 8


@pytest.mark.parametrize("runner", [race_threads, race_processes], ids=["threads", "processes"])
def test_takeover_waits_for_the_open_fenced_transaction(raw_env: HostEnv, runner: object) -> None:
    counts = runner(raw_env, ITERATIONS)  # type: ignore[operator]
    print(f"{raw_env.backend} {getattr(runner, '__name__', runner)}: {dict(counts)}")
    assert counts[VIOLATION] == 0
    assert sum(counts.values()) == ITERATIONS
    # With the default timeouts nothing gives up: every takeover waited for A's commit.
    assert counts[WAITED] == ITERATIONS, counts
    assert counts[TIMED_OUT] == 0
