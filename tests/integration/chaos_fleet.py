"""Test side of the chaos soaks: the fleet of worker processes and the chaos that hits them.

A :class:`Fleet` runs one :mod:`~tests.integration.chaos_worker` process per slot and restarts a
slot with a fresh process (a new engine id, ``w<slot>.<n>``) when the test kills it. A
:class:`Chaos` SIGKILLs a random worker every ``kill_every_s`` and now and then freezes one with
SIGSTOP until the claims it held have been taken over (or for ``pause_max_s``), then lets it run
on: it wakes deposed, the way a process stalled by GC or swap does. A test may hang more faults on
the chaos loop (``tick``), such as restores of older copies of the store.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.chaos_worker import ChaosConfig, counter_key, decode_counter, run_worker
from tests.integration.procs import (
    EXIT_TIMEOUT_S,
    Event,
    holders,
    journal_errors,
    journal_has,
    read_journal,
    sigkill,
    spawn,
    stop_all,
    tokens,
    wait_ready,
)
from weft_sync import keys
from weft_sync.codec import decode_epoch
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows


@dataclass(frozen=True)
class FleetSettings:
    """What every worker of a fleet runs with."""

    workers: int
    steps: int
    step_work_s: float
    """The activity of one step; it keeps workflows in flight while the chaos runs."""
    claim_ttl_ms: int
    claim_renew_interval_ms: int
    worker_max_s: float
    ready_timeout_s: float
    poll_s: float
    rewalk: bool = False
    """Give the workers a rewalk file (see :attr:`ChaosConfig.rewalk_path`)."""
    checkpoint_steps: bool = False
    """See :attr:`ChaosConfig.checkpoint_steps`."""
    drive_blocks: bool = False
    """See :attr:`ChaosConfig.drive_blocks`."""


@dataclass(frozen=True)
class ChaosSettings:
    """How often the chaos kills and freezes workers."""

    kill_every_s: float
    first_pause_s: float
    pause_every_s: float
    pause_max_s: float
    """A frozen worker runs on once its claims moved, or after this long (it may hold a lock)."""
    resume_grace_s: float
    """A worker that woke from a pause is not killed for this long: it journals its deposition."""
    journal_poll_s: float
    poll_s: float


# -- the fleet of worker processes -----------------------------------------------------------


@dataclass
class Incarnation:
    """One worker process: a slot's n-th start."""

    slot: int
    number: int
    config: ChaosConfig
    process: BaseProcess
    ready: bool = False
    killed: bool = False

    @property
    def name(self) -> str:
        return self.config.engine_id

    def journal(self) -> list[Event]:
        return read_journal(self.config.journal_path)

    def errors(self) -> list[str]:
        return journal_errors(self.config.journal_path)


@dataclass
class Fleet:
    """The worker slots, each running its current incarnation."""

    storage_url: str
    tmp_path: Path
    ids_path: Path
    settings: FleetSettings
    current: list[Incarnation] = field(default_factory=list)
    every: list[Incarnation] = field(default_factory=list)
    kills: int = 0
    rewalks: int = 0

    @property
    def go_path(self) -> Path:
        return self.tmp_path / "go"

    @property
    def stop_path(self) -> Path:
        return self.tmp_path / "stop"

    @property
    def rewalk_path(self) -> Path:
        return self.tmp_path / "rewalk"

    def spawn(self, slot: int) -> Incarnation:
        settings = self.settings
        number = sum(1 for inc in self.every if inc.slot == slot)
        name = f"w{slot}.{number}"
        config = ChaosConfig(
            storage_url=self.storage_url,
            engine_id=name,
            ids_path=str(self.ids_path),
            journal_path=str(self.tmp_path / f"{name}.jsonl"),
            log_path=str(self.tmp_path / f"{name}.log"),
            go_path=str(self.go_path),
            stop_path=str(self.stop_path),
            steps=settings.steps,
            step_work_s=settings.step_work_s,
            claim_ttl_ms=settings.claim_ttl_ms,
            claim_renew_interval_ms=settings.claim_renew_interval_ms,
            seed=1_000 * slot + number,
            max_duration_s=settings.worker_max_s,
            rewalk_path=str(self.rewalk_path) if settings.rewalk else None,
            checkpoint_steps=settings.checkpoint_steps,
            drive_blocks=settings.drive_blocks,
        )
        incarnation = Incarnation(slot, number, config, spawn(run_worker, config, name))
        self.every.append(incarnation)
        if slot < len(self.current):
            self.current[slot] = incarnation
        else:
            self.current.append(incarnation)
        return incarnation

    def is_ready(self, incarnation: Incarnation) -> bool:
        if not incarnation.ready:
            incarnation.ready = journal_has(incarnation.config.journal_path, "ready")
        return incarnation.ready

    def check_alive(self) -> None:
        """Fail when a worker the test did not kill has ended."""
        for incarnation in self.current:
            code = incarnation.process.exitcode
            if code is not None and not incarnation.killed:
                errors = incarnation.errors()
                pytest.fail(
                    f"worker {incarnation.name} exited with {code} while the test ran"
                    + (f":\n{errors[0]}" if errors else "")
                )

    def kill_and_restart(self, incarnation: Incarnation) -> None:
        incarnation.killed = True
        sigkill(incarnation.process, incarnation.name)
        self.kills += 1
        self.spawn(incarnation.slot)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        for incarnation in self.current:
            path = incarnation.config.journal_path
            wait_ready(incarnation.name, path, deadline, self.settings.poll_s, self.check_alive)
            incarnation.ready = True

    def rewalk(self) -> None:
        """Make every worker walk the id list again (written whole, so never read half done)."""
        self.rewalks += 1
        scratch = self.tmp_path / "rewalk.tmp"
        scratch.write_text(str(self.rewalks), encoding="utf-8")
        os.replace(scratch, self.rewalk_path)

    def stop(self) -> None:
        """Give the stop signal; every current worker must close its engine and exit 0."""
        self.stop_path.touch()
        for incarnation in self.current:
            incarnation.process.join(EXIT_TIMEOUT_S)
            errors = incarnation.errors()
            assert not errors, f"{incarnation.name} failed:\n{errors[0]}"
            assert incarnation.process.exitcode == 0, (
                f"{incarnation.name} exited with {incarnation.process.exitcode}"
            )

    def teardown(self) -> None:
        """Let frozen workers run, stop everyone, kill whoever does not end in time."""
        stop_all((incarnation.process for incarnation in self.current), self.stop_path)

    def events(self) -> list[tuple[Incarnation, list[Event]]]:
        return [(incarnation, incarnation.journal()) for incarnation in self.every]

    def fence_refused_at_store(self) -> bool:
        return any(
            e["ev"] == "stale" and e["via"] == "store" and e["outcome"] == "refused"
            for _, events in self.events()
            for e in events
        )


@contextmanager
def open_fleet(
    storage_url: str, tmp_path: Path, ids: list[str], settings: FleetSettings
) -> Iterator[Fleet]:
    """Spawn the first incarnation of every slot; give the go once all of them are ready."""
    ids_path = tmp_path / "ids.txt"
    ids_path.write_text("\n".join(ids) + "\n", encoding="utf-8")
    fleet = Fleet(storage_url, tmp_path, ids_path, settings)
    try:
        for slot in range(settings.workers):
            fleet.spawn(slot)
        fleet.wait_ready()
        fleet.go_path.touch()
        yield fleet
    finally:
        fleet.teardown()


# -- reading the store -----------------------------------------------------------------------


def completed_count(storage: Storage) -> int:
    return len(storage.scan(keys.workflow_status_index("completed", "")))


def describe_unfinished(storage: Storage, ids: list[str]) -> str:
    ledger = Workflows(storage)
    holder_of = holders(storage)
    lines = []
    for wid in ids:
        record = ledger.get(wid)
        if record is None or record.status != "completed":
            lines.append(
                f"{wid}: status {None if record is None else record.status}, holder "
                f"{holder_of.get(wid)}, steps {decode_counter(storage.get(counter_key(wid)))}"
            )
    return "\n".join(lines[:20]) + (f"\n... {len(lines)} in all" if len(lines) > 20 else "")


def wait_all_completed(fleet: Fleet, storage: Storage, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while completed_count(storage) < len(ids):
        fleet.check_alive()
        if time.monotonic() > deadline:
            pytest.fail(
                f"not every workflow completed within {timeout_s} s after the chaos:\n"
                + describe_unfinished(storage, ids)
            )
        time.sleep(fleet.settings.poll_s * 4)


# -- the chaos -------------------------------------------------------------------------------


@dataclass
class _Pause:
    incarnation: Incarnation
    held: dict[str, bytes | None]
    """``{workflow id: token}`` of the claims the frozen worker held when it was frozen."""
    since: float
    driving: str | None
    """The workflow its driver was working on, as far as its journal tells."""


@dataclass
class Chaos:
    """Kills a worker every ``kill_every_s`` and freezes one every ``pause_every_s``."""

    fleet: Fleet
    storage: Storage
    rng: random.Random
    settings: ChaosSettings
    pause: _Pause | None = None
    pauses: int = 0
    pauses_deposed: int = 0
    grace: dict[int, float] = field(default_factory=dict)
    resumed: list[dict[str, Any]] = field(default_factory=list)
    """One record per pause that ended: who, the epochs it held and the store's at the end."""

    def run(
        self,
        min_s: float,
        max_s: float,
        enough: Callable[[], bool],
        tick: Callable[[float], None] | None = None,
    ) -> None:
        """Kill and freeze workers for ``min_s`` and until ``enough()`` says so.

        Never longer than ``max_s`` (plus the end of a pause in progress). ``tick(now)`` runs
        on every round of the loop.
        """
        settings = self.settings
        start = time.monotonic()
        next_kill = start + settings.kill_every_s
        next_pause = start + settings.first_pause_s
        next_check = start + min_s
        while True:
            now = time.monotonic()
            self.fleet.check_alive()
            if tick is not None:
                tick(now)
            if self.pause is not None:
                self._maybe_resume(now)
            if self.pause is None and now >= next_check:
                if now - start >= max_s or enough():
                    return
                next_check = now + settings.journal_poll_s
            if now >= next_kill:
                self._kill_one(now)
                next_kill = now + settings.kill_every_s * self.rng.uniform(0.8, 1.2)
            if self.pause is None and now >= next_pause:
                frozen = self.freeze(now)
                next_pause = now + (settings.pause_every_s if frozen else settings.poll_s * 4)
            time.sleep(settings.poll_s)

    def _eligible(self, now: float) -> list[Incarnation]:
        paused = None if self.pause is None else self.pause.incarnation
        return [
            inc
            for inc in self.fleet.current
            if inc is not paused
            and self.grace.get(inc.slot, 0.0) <= now
            and inc.process.exitcode is None
            and self.fleet.is_ready(inc)
        ]

    def _kill_one(self, now: float) -> None:
        candidates = self._eligible(now)
        if candidates:
            self.fleet.kill_and_restart(self.rng.choice(candidates))

    def candidates(self, now: float) -> list[Incarnation]:
        """The workers :meth:`freeze` may freeze now: running, ready, and holding claims."""
        holding = {engine for engine, _ in holders(self.storage).values()}
        return [inc for inc in self._eligible(now) if inc.name in holding]

    def freeze(
        self,
        now: float,
        prefer: Callable[[list[Incarnation]], list[Incarnation]] | None = None,
    ) -> bool:
        """Freeze a random worker that holds claims (unless one is frozen); ``False``: none.

        :param prefer: narrows the candidates down to those to freeze rather (when it returns
            none, any candidate will do).
        """
        if self.pause is not None:
            return False
        candidates = self.candidates(now)
        if prefer is not None:
            candidates = prefer(candidates) or candidates
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        pid = victim.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        token_of = tokens(self.storage)
        held = {
            wid: token_of.get(wid)
            for wid, (engine, _) in holders(self.storage).items()
            if engine == victim.name
        }
        if not held:
            os.kill(pid, signal.SIGCONT)
            return False
        self.pause = _Pause(victim, held, now, driving(victim.journal()))
        self.pauses += 1
        return True

    def thaw(self) -> None:
        """Let the frozen worker run on at once, as if it had never been frozen."""
        assert self.pause is not None
        pid = self.pause.incarnation.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGCONT)
        self.pause = None
        self.pauses -= 1

    def _maybe_resume(self, now: float) -> None:
        assert self.pause is not None
        token_of = tokens(self.storage)
        # A claim moved when its epoch key holds another token at the same epoch number or a
        # later one: a successor's, or after a restore of an older copy, one minted again.
        held = self.pause.held
        moved = all(_moved(token, token_of.get(wid)) for wid, token in held.items())
        if not moved and now - self.pause.since < self.settings.pause_max_s:
            return
        self._resume(now, moved, token_of)

    def end_pause(self, now: float) -> None:
        """Let the frozen worker run on now, whether or not its claims moved."""
        assert self.pause is not None
        token_of = tokens(self.storage)
        held = self.pause.held
        self._resume(now, all(_moved(t, token_of.get(w)) for w, t in held.items()), token_of)

    def _resume(self, now: float, moved: bool, token_of: dict[str, bytes]) -> None:
        assert self.pause is not None
        incarnation = self.pause.incarnation
        assert incarnation.process.pid is not None
        os.kill(incarnation.process.pid, signal.SIGCONT)
        self.resumed.append(
            {
                "engine": incarnation.name,
                "t": time.monotonic_ns(),
                "moved": moved,
                "driving": self.pause.driving,
                "held": {w: _epoch(t) for w, t in self.pause.held.items()},
                "store": {w: _epoch(token_of.get(w)) for w in self.pause.held},
            }
        )
        self.pauses_deposed += int(moved)
        self.grace[incarnation.slot] = now + self.settings.resume_grace_s
        self.pause = None


def _moved(held: bytes | None, now: bytes | None) -> bool:
    if now is None or now == held:
        return False
    held_epoch, now_epoch = decode_epoch(held), decode_epoch(now)
    return held_epoch is None or (now_epoch is not None and now_epoch >= held_epoch)


def _epoch(token: bytes | None) -> int | None:
    return None if token is None else decode_epoch(token)


_DRIVE_ENDS = frozenset({"completed", "deposed", "storage_error", "not_running"})


def driving(events: list[Event]) -> str | None:
    """The workflow a worker's driver is on, from its journal: its last drive not yet ended."""
    driving = None
    for event in events:
        if event["ev"] == "drive":
            driving = event["wf"]
        elif event["ev"] in _DRIVE_ENDS and event.get("wf") == driving:
            driving = None
    return driving
