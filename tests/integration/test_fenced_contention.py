"""Four engine processes fight over 200 workflows; the epoch fence keeps every log consistent.

Each contender (see :mod:`tests.integration.contention_worker`) runs its own engine with interval
renewal and reclaim (TTL 900 ms, renew interval 300 ms, wall clock, real timer) and, while it
holds a workflow, appends entries to that workflow's log with a compare-and-swap fenced on its
epoch. Afterwards the logs must show that the fence admitted writes only from the epoch's
holder: per workflow, epochs never go backwards, each epoch's entries come from one engine, no
replayed stale-epoch write got in, and every entry matches a write its engine saw succeed.

The handovers the checks need are driven by the test, not left to chance (a loaded machine runs
fewer turns): once a contender holds and has written to ``MIN_HANDOVERS`` workflows, it is
paused (SIGSTOP, outside any write) or killed, and the test waits until another engine has
written to each of them; the paused one is then continued and replays its stale writes.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from tests.examples.gunicorn_harness import write_locks_held
from tests.integration.contention_worker import (
    ContenderConfig,
    LogEntry,
    decode_log_entry,
    decode_log_head,
    log_entry_key,
    log_entry_prefix,
    log_head_key,
    run_contender,
)
from tests.integration.procs import (
    EXIT_TIMEOUT_S,
    Event,
    epochs,
    holders,
    read_journal,
    sigkill,
    spawn,
    stop_all,
    wait_ready,
)
from tests.support.postgres_activity import dsn_of, idle_in_transaction
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.codec import WorkflowRecord, decode_epoch, encode_workflow_record
from weft_sync.storage import Put, Storage

CONTENDERS = 4
WORKFLOWS = 200
TTL_MS = 900
RENEW_MS = 300
KILL_AFTER_S = 2.0
"""Contest time before the victim is killed or paused (once it holds and wrote to
``MIN_HANDOVERS`` claims)."""
HANG_GUARD_S = 120.0
"""Fails a takeover that never completes; far above the bound (TTL + 2 renew + one interval)."""
AFTER_TAKEOVER_S = 1.0
"""Contest time left to the survivors once they took over every claim of the victim."""
MAX_CONTEST_S = 30.0
"""A contender stops on its own after this long, should the stop signal never come."""
READY_TIMEOUT_S = 60.0
POLL_S = 0.02
MIN_HANDOVERS = 5
"""Workflows whose log has entries from at least two engines: proof that they contended."""
STOP_ATTEMPTS = 200

# Hang guards only, generous for a loaded machine: spawning four interpreters and waiting for
# the driven handovers can take minutes there.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

Written = tuple[str, int, int]
"""``(workflow id, epoch, seq)`` of one log entry."""


@dataclass
class _Contender:
    config: ContenderConfig
    process: BaseProcess

    def check_alive(self) -> None:
        assert self.process.is_alive(), (
            f"{self.config.engine_id} died before it was ready (exit {self.process.exitcode})"
        )

    def journal(self) -> list[Event]:
        return read_journal(self.config.journal_path)

    def summary(self) -> Event:
        events = self.journal()
        errors = [e["traceback"] for e in events if e["ev"] == "error"]
        assert not errors, f"{self.config.engine_id} failed:\n{errors[0]}"
        summaries = [e for e in events if e["ev"] == "summary"]
        assert len(summaries) == 1, f"{self.config.engine_id} wrote no summary"
        return summaries[0]


def _seed_running_workflows(storage: Storage) -> list[str]:
    """Store ``WORKFLOWS`` running workflows (records and index entries); return their ids."""
    ids = [f"wf-{n:03d}" for n in range(WORKFLOWS)]
    operations: list[Put] = []
    for wid in ids:
        record = WorkflowRecord(wid, "import", "running")
        operations.append(Put(keys.workflow(wid), encode_workflow_record(record)))
        operations.append(Put(keys.workflow_status_index("running", wid), b""))
    storage.batch(operations)
    return ids


@contextmanager
def _contest(storage_url: str, tmp_path: Path, ids: list[str]) -> Iterator[list[_Contender]]:
    """Spawn the contenders, wait until all are ready and give the go.

    On exit the stop signal is given (if the test has not given it) and contenders that do not
    end in time are killed.
    """
    go_path = tmp_path / "go"
    stop_path = tmp_path / "stop"
    contenders: list[_Contender] = []
    try:
        for n in range(CONTENDERS):
            config = ContenderConfig(
                storage_url=storage_url,
                engine_id=f"engine-{n}",
                workflow_ids=tuple(ids),
                journal_path=str(tmp_path / f"engine-{n}.jsonl"),
                log_path=str(tmp_path / f"engine-{n}.log"),
                go_path=str(go_path),
                stop_path=str(stop_path),
                max_duration_s=MAX_CONTEST_S,
                claim_ttl_ms=TTL_MS,
                claim_renew_interval_ms=RENEW_MS,
                seed=1000 + n,
            )
            process = spawn(run_contender, config, config.engine_id)
            contenders.append(_Contender(config, process))
        _wait_ready(contenders)
        go_path.touch()
        yield contenders
    finally:
        stop_all((c.process for c in contenders), stop_path)


def _stop(contenders: list[_Contender]) -> None:
    """Give the stop signal and wait for every live contender to end cleanly."""
    Path(contenders[0].config.stop_path).touch()
    for contender in contenders:
        if contender.process.exitcode is not None:
            continue
        contender.process.join(EXIT_TIMEOUT_S)
        assert contender.process.exitcode == 0, (
            f"{contender.config.engine_id} exited with {contender.process.exitcode}"
        )


def _wait_ready(contenders: list[_Contender]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for contender in contenders:
        name = contender.config.engine_id
        wait_ready(name, contender.config.journal_path, deadline, POLL_S, contender.check_alive)


def _read_logs(storage: Storage, ids: list[str]) -> dict[str, list[LogEntry]]:
    """Every workflow's log, checked to be the gap-free sequence its head counts."""
    logs: dict[str, list[LogEntry]] = {}
    for wid in ids:
        count = decode_log_head(storage.get(log_head_key(wid)))
        rows = storage.scan(log_entry_prefix(wid))
        assert [key for key, _ in rows] == [log_entry_key(wid, seq) for seq in range(count)]
        entries = [decode_log_entry(value) for _, value in rows]
        assert [entry.seq for entry in entries] == list(range(count))
        logs[wid] = entries
    return logs


def _assert_fenced(storage: Storage, logs: dict[str, list[LogEntry]]) -> None:
    """Per workflow: epochs never go backwards, one writer per epoch, no stale entry."""
    for wid, entries in logs.items():
        epochs = [entry.epoch for entry in entries]
        assert epochs == sorted(epochs), f"epochs went backwards in the log of {wid}: {epochs}"
        writers: defaultdict[int, set[str]] = defaultdict(set)
        for entry in entries:
            writers[entry.epoch].add(entry.worker)
        shared = {epoch: w for epoch, w in writers.items() if len(w) > 1}
        assert not shared, f"several engines wrote under one epoch of {wid}: {shared}"
        assert not [e for e in entries if e.stale], f"a stale-epoch write got into {wid}'s log"
        if entries:
            current = decode_epoch(storage.get(keys.workflow_owner_epoch(wid)))
            assert current is not None and epochs[-1] <= current


def _written_by(logs: dict[str, list[LogEntry]]) -> dict[str, set[Written]]:
    found: defaultdict[str, set[Written]] = defaultdict(set)
    for wid, entries in logs.items():
        for entry in entries:
            found[entry.worker].add((wid, entry.epoch, entry.seq))
    return found


def _journaled_writes(events: list[Event]) -> tuple[set[Written], Written | None]:
    """The writes a journal saw commit, and the write in flight when it ends (if any)."""
    accepted: set[Written] = set()
    pending: Written | None = None
    for event in events:
        if event["ev"] == "intent":
            pending = (event["wf"], event["epoch"], event["seq"])
        elif event["ev"] in ("ok", "refused"):
            assert pending is not None and (event["wf"], event["seq"]) == (pending[0], pending[2])
            if event["ev"] == "ok":
                accepted.add(pending)
            pending = None
    return accepted, pending


def _assert_logs_match_journals(
    logs: dict[str, list[LogEntry]], finished: list[_Contender]
) -> dict[str, set[Written]]:
    """Each finished engine's entries are exactly the writes its journal saw commit.

    :returns: the entries of every engine, finished or not.
    """
    written = _written_by(logs)
    for contender in finished:
        accepted, pending = _journaled_writes(contender.journal())
        assert pending is None, f"{contender.config.engine_id} ended inside a write"
        assert written.get(contender.config.engine_id, set()) == accepted
    return written


def _held_and_written(storage: Storage, engine_id: str) -> dict[str, int]:
    """The workflows ``engine_id`` holds whose log has an entry of its at the current epoch."""
    held = {wid: epoch for wid, (engine, epoch) in holders(storage).items() if engine == engine_id}
    written = {}
    for wid, epoch in held.items():
        count = decode_log_head(storage.get(log_head_key(wid)))
        if count and any(
            (entry.worker, entry.epoch) == (engine_id, epoch)
            for entry in (decode_log_entry(v) for _, v in storage.scan(log_entry_prefix(wid)))
        ):
            written[wid] = epoch
    return written


def _wait_until_holding_written(storage: Storage, engine_id: str, count: int) -> None:
    wait_until(
        lambda: len(_held_and_written(storage, engine_id)) >= count,
        f"{engine_id} to hold and write to {count} claims at once",
        timeout_s=HANG_GUARD_S,
        poll_s=POLL_S,
    )


def _wait_for_handovers(storage: Storage, ids: list[str], since: float) -> None:
    """Wait until ``MIN_HANDOVERS`` workflows' logs have entries of two engines or more."""
    while True:
        changed = 0
        for wid in ids:
            workers = {decode_log_entry(v).worker for _, v in storage.scan(log_entry_prefix(wid))}
            changed += len(workers) > 1
        if changed >= MIN_HANDOVERS:
            return
        assert time.monotonic() - since < HANG_GUARD_S, f"only {changed} workflows changed hands"
        time.sleep(POLL_S * 10)


def _busy(pid: int, storage_url: str) -> bool:
    """Whether ``pid`` (stopped) may hold a lock the other contenders need."""
    if storage_url.startswith("sqlite"):
        return bool(write_locks_held(pid))
    return idle_in_transaction(dsn_of(storage_url)[0])


def _stop_outside_writes(contender: _Contender) -> None:
    """SIGSTOP the contender at a moment it holds no lock the others need."""
    pid = contender.process.pid
    assert pid is not None
    for attempt in range(STOP_ATTEMPTS):
        os.kill(pid, signal.SIGSTOP)
        _wait_stopped(pid)
        if not _busy(pid, contender.config.storage_url):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.003 * (attempt % 7 + 1))
    raise AssertionError(f"{contender.config.engine_id} was never stopped outside a write")


def _wait_stopped(pid: int) -> None:
    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    wait_until(stopped, f"process {pid} to stop", timeout_s=EXIT_TIMEOUT_S, poll_s=0.001)


def _pause_holding_written(contender: _Contender, storage: Storage, count: int) -> dict[str, int]:
    """SIGSTOP the contender, outside a write, once it holds and wrote to ``count`` claims.

    :returns: those claims (id -> epoch), read while it is stopped.
    """
    name = contender.config.engine_id
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        _wait_until_holding_written(storage, name, count)
        _stop_outside_writes(contender)
        taken = _held_and_written(storage, name)
        if len(taken) >= count:
            return taken
        os.kill(contender.process.pid, signal.SIGCONT)  # type: ignore[arg-type]
        assert time.monotonic() < deadline, f"{name} never stopped holding {count} claims"


def _stale_refused(contender: _Contender) -> int:
    """How many of its replayed stale writes the contender's journal shows refused."""
    count, stale = 0, False
    for event in contender.journal():
        if event["ev"] == "intent":
            stale = bool(event["stale"])
        elif event["ev"] == "refused" and stale:
            count += 1
    return count


def _unmoved(storage: Storage, stranded: dict[str, int]) -> list[str]:
    """The ids whose epoch is still the one in ``stranded``."""
    current = epochs(storage)
    return [wid for wid, epoch in stranded.items() if current.get(wid, 0) <= epoch]


def _assert_contended(
    logs: dict[str, list[LogEntry]], summaries: list[Event], *, stale_replayed: bool
) -> None:
    """The run exercised what it claims to: handovers, stale replays, the reclaim target."""
    handovers = sum(1 for entries in logs.values() if len({e.worker for e in entries}) > 1)
    assert handovers >= MIN_HANDOVERS, f"only {handovers} workflows changed hands"
    counts: Counter[str] = Counter()
    for summary in summaries:
        counts.update(summary["counts"])
        assert summary["counts"]["task_closed"] == 1
        assert summary["counts"]["stopped_by_file"] == 1
    assert counts["stale_accepted"] == 0
    if stale_replayed:
        assert counts["stale_refused"] >= 1, f"no stale write was attempted: {dict(counts)}"
    assert counts["fenced_accepted"] > 0
    assert counts["release_released"] > 0
    reclaimed = sum(s["attempts"]["acquired"] + s["attempts"]["takeover"] for s in summaries)
    assert reclaimed > 0, "the reclaim target never claimed anything"


def test_epoch_fence_admits_only_the_holders_writes_under_contention(
    storage_url: str, open_store: Callable[[], Storage], tmp_path: Path
) -> None:
    store = open_store()
    ids = _seed_running_workflows(store)

    with _contest(storage_url, tmp_path, ids) as contenders:
        paused = contenders[0]
        name = paused.config.engine_id
        time.sleep(KILL_AFTER_S)
        taken = _pause_holding_written(paused, store, MIN_HANDOVERS)
        try:
            # Its claims expire; the others take them over and write under newer epochs.
            assert taken
            _wait_for_handovers(store, ids, time.monotonic())
        finally:
            os.kill(paused.process.pid, signal.SIGCONT)  # type: ignore[arg-type]
        # Continued, it replays writes under the epochs it held: each one refused.
        wait_until(
            lambda: _stale_refused(paused) > 0,
            f"{name} to replay a stale write",
            timeout_s=HANG_GUARD_S,
            poll_s=POLL_S,
        )
        _stop(contenders)
    summaries = [c.summary() for c in contenders]

    logs = _read_logs(store, ids)
    _assert_fenced(store, logs)
    _assert_logs_match_journals(logs, contenders)
    _assert_contended(logs, summaries, stale_replayed=True)
    # Every engine released what it held when it stopped.
    assert holders(store) == {}


def test_killed_engine_is_taken_over_and_its_log_ends_at_its_last_accepted_write(
    storage_url: str, open_store: Callable[[], Storage], tmp_path: Path
) -> None:
    store = open_store()
    ids = _seed_running_workflows(store)

    with _contest(storage_url, tmp_path, ids) as contenders:
        victim, survivors = contenders[0], contenders[1:]
        time.sleep(KILL_AFTER_S)
        _wait_until_holding_written(store, victim.config.engine_id, MIN_HANDOVERS)
        killed_at = time.monotonic()
        sigkill(victim.process, victim.config.engine_id)
        stranded = {
            wid: epoch
            for wid, (engine, epoch) in holders(store).items()
            if engine == victim.config.engine_id
        }
        assert stranded, "the victim released everything just before it was killed"
        written_before = _held_and_written(store, victim.config.engine_id)
        # A hang guard only: the takeover time is measured by bench/takeover_latency.py.
        while unmoved := _unmoved(store, stranded):
            assert time.monotonic() - killed_at < HANG_GUARD_S, (
                f"claims of the killed engine never moved: {unmoved}"
            )
            time.sleep(POLL_S)
        # The survivors write to the claims the victim held and had written to: handovers.
        assert written_before
        _wait_for_handovers(store, ids, time.monotonic())
        time.sleep(AFTER_TAKEOVER_S)
        _stop(survivors)
    summaries = [c.summary() for c in survivors]

    logs = _read_logs(store, ids)
    _assert_fenced(store, logs)
    written = _assert_logs_match_journals(logs, survivors)
    # The victim's log entries are the writes it saw commit, plus at most the one in flight
    # when it died; nothing of it lands later.
    accepted, pending = _journaled_writes(victim.journal())
    assert accepted, "the victim never wrote"
    victim_written = written.get(victim.config.engine_id, set())
    assert accepted <= victim_written <= accepted | ({pending} if pending else set())
    # Only a takeover replaces a holder nobody released: each stranded claim needed one.
    takeovers = sum(
        s["attempts"]["takeover"] + s["counts"].get("takeover_acquired", 0) for s in summaries
    )
    assert takeovers >= len(stranded)
    assert _unmoved(store, stranded) == []
    for wid, epoch in stranded.items():
        assert all(e.epoch <= epoch for e in logs[wid] if e.worker == victim.config.engine_id)
    # The survivors released what they held, the victim's takeovers included: none is left.
    assert holders(store) == {}
    _assert_contended(logs, summaries, stale_replayed=False)
