"""Chaos: six workers drive 500 workflows while the test keeps killing and pausing them.

Each worker (see :mod:`tests.integration.chaos_worker`; the fleet and the chaos are in
:mod:`tests.integration.chaos_fleet`) is a spawned interpreter with its own
``Ownership`` (TTL 900 ms, renew interval 300 ms, wall clock, background maintenance). Workers
start workflows from one shared id list, drive each through fenced steps and complete it; a
workflow stranded by a dead or stalled worker is reclaimed by another one, whose
``on_reclaimed`` resumes it from its step counter.

While the workers run, the test SIGKILLs a random one every half second and restarts it (a fresh
process and engine), and now and then freezes one with SIGSTOP until the claims it held have been
taken over, then lets it run on: it wakes deposed, the way a process stalled by GC or swap does,
and its journal records that its next writes, and a replay naming its stale token, were refused.
Then the killing stops, every workflow must reach ``completed``, and the store's own data must
show that the epoch fence let no write through under a superseded epoch.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.chaos_fleet import (
    Chaos,
    ChaosSettings,
    Fleet,
    FleetSettings,
    open_fleet,
    wait_all_completed,
)
from tests.integration.chaos_worker import (
    StepEntry,
    counter_key,
    decode_counter,
    decode_step_entry,
    step_prefix,
)
from tests.integration.procs import epochs
from weft_sync.codec import WorkflowRecord
from weft_sync.storage import Storage
from weft_sync.workflows import WorkflowOutcome, Workflows

WORKERS = 6
WORKFLOWS = 500
STEPS = 5
STEP_WORK_S = 0.03
"""The activity of one step; it keeps workflows in flight while the chaos runs."""
TTL_MS = 900
RENEW_MS = 300
KILL_EVERY_S = 0.5
CHAOS_MIN_S = 12.0
CHAOS_MAX_S = 20.0
"""The chaos outlasts ``CHAOS_MIN_S`` only until a stale write was refused at the store."""
FIRST_PAUSE_S = 1.0
PAUSE_EVERY_S = 3.0
PAUSE_MAX_S = 4.0
"""A frozen worker runs on once its claims moved, or after this long (it may hold a store lock)."""
RESUME_GRACE_S = 1.5
"""A worker that woke from a pause is not killed for this long: it journals its deposition."""
READY_TIMEOUT_S = 60.0
COMPLETE_TIMEOUT_S = 60.0
WORKER_MAX_S = 170.0
POLL_S = 0.05
JOURNAL_POLL_S = 0.5

FLEET = FleetSettings(
    workers=WORKERS,
    steps=STEPS,
    step_work_s=STEP_WORK_S,
    claim_ttl_ms=TTL_MS,
    claim_renew_interval_ms=RENEW_MS,
    worker_max_s=WORKER_MAX_S,
    ready_timeout_s=READY_TIMEOUT_S,
    poll_s=POLL_S,
)
CHAOS = ChaosSettings(
    kill_every_s=KILL_EVERY_S,
    first_pause_s=FIRST_PAUSE_S,
    pause_every_s=PAUSE_EVERY_S,
    pause_max_s=PAUSE_MAX_S,
    resume_grace_s=RESUME_GRACE_S,
    journal_poll_s=JOURNAL_POLL_S,
    poll_s=POLL_S,
)

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(180)]


# -- reading the store -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    """What the store holds for one workflow at the end."""

    record: WorkflowRecord
    outcome: WorkflowOutcome | None
    counter: int
    entries: dict[int, StepEntry]
    epoch: int


def _read_store(storage: Storage, ids: list[str]) -> dict[str, _Stored]:
    ledger = Workflows(storage)
    epoch_of = epochs(storage)
    stored: dict[str, _Stored] = {}
    for wid in ids:
        record = ledger.get(wid)
        assert record is not None, f"workflow {wid} was never started"
        rows = storage.scan(step_prefix(wid))
        entries = {int(key[len(step_prefix(wid)) :]): decode_step_entry(raw) for key, raw in rows}
        stored[wid] = _Stored(
            record,
            ledger.get_outcome(wid),
            decode_counter(storage.get(counter_key(wid))),
            entries,
            epoch_of[wid],
        )
    return stored


# -- reading the journals --------------------------------------------------------------------

StepId = tuple[str, int]
"""``(workflow id, step)``."""
Write = tuple[str, int]
"""``(engine id, epoch)`` of one step write."""


@dataclass
class _Journals:
    """Every worker's journal, folded into what the checks need."""

    accepted: dict[StepId, list[Write]] = field(default_factory=lambda: defaultdict(list))
    unresolved: dict[StepId, list[Write]] = field(default_factory=lambda: defaultdict(list))
    holders: dict[tuple[str, int], set[str]] = field(default_factory=lambda: defaultdict(set))
    drives: list[tuple[str, int, int]] = field(default_factory=list)
    """``(workflow id, epoch, first step)`` of every drive, read after the claim was held."""
    ambiguous: set[StepId] = field(default_factory=set)
    stale: Counter[tuple[str, str]] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)


def _fold_journals(fleet: Fleet) -> _Journals:
    folded = _Journals()
    for incarnation, events in fleet.events():
        engine = incarnation.name
        pending: tuple[StepId, int] | None = None
        for event in events:
            kind = event["ev"]
            folded.counts[kind] += 1
            if kind in ("start", "reclaimed", "drive") and event["epoch"] is not None:
                folded.holders[event["wf"], event["epoch"]].add(engine)
            if kind == "drive":
                folded.drives.append((event["wf"], event["epoch"], event["step"]))
            elif kind == "intent":
                assert pending is None, f"{engine}: an intent was never resolved: {pending}"
                pending = ((event["wf"], event["step"]), event["epoch"])
            elif kind in ("ok", "deposed", "conflict", "storage_error") and pending is not None:
                step_id, epoch = pending
                assert step_id[0] == event["wf"], f"{engine}: {event} resolves {pending}"
                if kind == "ok":
                    folded.accepted[step_id].append((engine, epoch))
                elif kind == "storage_error":
                    # The write may have committed before the error reached the worker.
                    folded.unresolved[step_id].append((engine, epoch))
                pending = None
            elif kind == "ambiguous":
                folded.ambiguous.add((event["wf"], event["step"]))
            elif kind == "stale":
                folded.stale[event["via"], event["outcome"]] += 1
        if pending is not None:
            # Killed inside the write: it may or may not have landed.
            assert incarnation.killed, f"{engine} stopped cleanly inside a write: {pending}"
            folded.unresolved[pending[0]].append((engine, pending[1]))
    return folded


# -- the checks ------------------------------------------------------------------------------


def _assert_all_completed(stored: dict[str, _Stored]) -> None:
    for wid, item in stored.items():
        assert item.record.status == "completed", f"{wid} ended {item.record.status}"
        assert item.outcome is not None and item.outcome.status == "completed", wid
        assert item.counter == STEPS, f"{wid} ran {item.counter} steps, not {STEPS}"
        assert sorted(item.entries) == list(range(STEPS)), f"{wid} has steps {item.entries}"


def _assert_epochs_fenced(stored: dict[str, _Stored], journals: _Journals) -> None:
    """Per workflow: epochs never go back, one engine per epoch, each held by its writer."""
    for wid, item in stored.items():
        entries = [item.entries[step] for step in range(STEPS)]
        assert [e.step for e in entries] == list(range(STEPS)), f"{wid}: misfiled step entries"
        assert not [e for e in entries if e.stale], f"a stale-epoch write landed in {wid}"
        epochs = [e.epoch for e in entries]
        assert epochs == sorted(epochs), f"epochs of {wid} went backwards: {epochs}"
        writers: defaultdict[int, set[str]] = defaultdict(set)
        for entry in entries:
            writers[entry.epoch].add(entry.engine)
            assert entry.engine in journals.holders[wid, entry.epoch], (
                f"{entry.engine} wrote step {entry.step} of {wid} under epoch {entry.epoch}, "
                f"which its journal never shows it holding"
            )
        shared = {epoch: names for epoch, names in writers.items() if len(names) > 1}
        assert not shared, f"several engines wrote under one epoch of {wid}: {shared}"
        assert item.outcome is not None
        finished_epoch = item.outcome.result["epoch"]
        assert epochs[-1] <= finished_epoch <= item.epoch, (
            f"{wid}: last step under epoch {epochs[-1]}, completed under {finished_epoch}, "
            f"epoch key {item.epoch}"
        )
    for (wid, epoch), names in journals.holders.items():
        assert len(names) == 1, f"epoch {epoch} of {wid} was held by {sorted(names)}"


def _assert_no_write_after_supersession(stored: dict[str, _Stored], journals: _Journals) -> None:
    """Once a new owner read the step counter, every later step carries its epoch or a newer one.

    A drive reads the counter only after its claim (epoch ``E``) is held, so an entry at or past
    that step under an older epoch would be a write accepted after ``E`` superseded it.
    """
    for wid, epoch, first_step in journals.drives:
        for step in range(first_step, STEPS):
            entry = stored[wid].entries[step]
            if (wid, step) in journals.ambiguous:
                continue
            assert entry.epoch >= epoch, (
                f"step {step} of {wid} was written under epoch {entry.epoch} by {entry.engine} "
                f"after epoch {epoch} took over at step {first_step}"
            )


def _assert_each_step_written_once(stored: dict[str, _Stored], journals: _Journals) -> None:
    """Every write a journal saw commit is the stored entry; every stored entry was intended."""
    for (wid, step), writes in journals.accepted.items():
        assert len(writes) == 1, f"step {step} of {wid} was accepted {len(writes)} times: {writes}"
        entry = stored[wid].entries[step]
        assert (entry.engine, entry.epoch) == writes[0], (
            f"step {step} of {wid} holds {entry} but {writes[0]} saw its write commit"
        )
    for wid, item in stored.items():
        for step, entry in item.entries.items():
            landed = (entry.engine, entry.epoch)
            candidates = journals.accepted.get((wid, step), []) + journals.unresolved.get(
                (wid, step), []
            )
            assert landed in candidates, f"step {step} of {wid} holds a write nobody intended"


def _assert_exercised(chaos: Chaos, stored: dict[str, _Stored], journals: _Journals) -> None:
    """The run did what it claims: kills, takeovers, stale writes refused by the store."""
    assert chaos.fleet.kills >= 1, "no worker was killed"
    taken_over = [
        wid
        for wid, item in stored.items()
        if item.outcome is not None and item.record.input["engine"] != item.outcome.result["engine"]
    ]
    assert taken_over, "no workflow was finished by another worker than its starter"
    assert journals.stale["store", "accepted"] == 0
    assert journals.stale["ledger", "accepted"] == 0
    assert journals.stale["store", "refused"] >= 1, (
        f"the fence was never exercised by a stale write: {dict(journals.stale)}; "
        f"{chaos.pauses_deposed} pauses ended with the frozen worker's claims taken over"
    )
    assert journals.counts["conflict"] == 0, "two writers shared one epoch"
    assert journals.counts["error"] == 0


def _assert_clean_stops(fleet: Fleet) -> None:
    for incarnation in fleet.current:
        summaries = [e for e in incarnation.journal() if e["ev"] == "summary"]
        assert len(summaries) == 1, f"{incarnation.name} wrote no summary"
        assert summaries[0]["counts"]["stopped_by_file"] == 1


def test_killed_and_paused_workers_complete_every_workflow_without_a_stale_write(
    storage_url: str, open_store: Callable[[], Storage], tmp_path: Path
) -> None:
    store = open_store()
    ids = [f"chaos-{n:03d}" for n in range(WORKFLOWS)]

    with open_fleet(storage_url, tmp_path, ids, FLEET) as fleet:
        chaos = Chaos(fleet, store, random.Random(4242), CHAOS)
        chaos.run(CHAOS_MIN_S, CHAOS_MAX_S, fleet.fence_refused_at_store)
        wait_all_completed(fleet, store, ids, COMPLETE_TIMEOUT_S)
        fleet.stop()

    stored = _read_store(store, ids)
    journals = _fold_journals(fleet)
    _assert_all_completed(stored)
    _assert_epochs_fenced(stored, journals)
    _assert_no_write_after_supersession(stored, journals)
    _assert_each_step_written_once(stored, journals)
    _assert_exercised(chaos, stored, journals)
    _assert_clean_stops(fleet)
