"""A fleet of eight engines in separate processes; one is SIGKILLed and the others drive its work.

The TTL is a minute, far longer than the test may wait, so every takeover seen here comes from
crash detection (the victim's session lock vanished with its process), not from expiry. Two
survivors are of the other kinds a fleet can hold: one discovers by the full scan (the fallback)
and one runs on a store without session locks (its own liveness is its heartbeat alone). Both
must behave: drive what they take, as the new owner, and leave nothing stranded.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from tests.integration.fleet_worker import FleetEngine, run_engine
from tests.integration.procs import (
    journal_errors,
    read_journal,
    sigkill,
    spawn,
    stop_all,
    wait_ready,
)
from weft_sync import Ownership, keys
from weft_sync.codec import decode_epoch, decode_holder
from weft_sync.storage import Storage

ENGINES = 8
WORKFLOWS = 56
DEADLINE_S = 45.0
"""Far below the one-minute TTL: finishing by then proves the crash was seen, not waited out."""
POLL_S = 0.05
VARIANTS = {1: "scan", 2: "lockless"}

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, url: str, index: int, workflows: list[str]) -> FleetEngine:
    return FleetEngine(
        name=f"engine-{index}",
        url=url,
        journal=str(tmp_path / f"engine-{index}.jsonl"),
        log=str(tmp_path / f"engine-{index}.log"),
        go=str(tmp_path / "go"),
        stop=str(tmp_path / "stop"),
        workflows=workflows,
        variant=VARIANTS.get(index, "auto"),
    )


def _engine_when_ready(config: FleetEngine, process: BaseProcess, deadline: float) -> str:
    """Wait for ``config``'s engine to journal ``ready``; return its engine id."""

    def alive() -> None:
        assert process.is_alive(), (config.name, journal_errors(config.journal))

    wait_ready(config.name, config.journal, deadline, POLL_S, alive)
    ready = [e for e in read_journal(config.journal) if e["ev"] == "ready"]
    return str(ready[0]["engine"])


def _drives(configs: list[FleetEngine]) -> list[tuple[str, str, int]]:
    """Every drive journaled so far: (engine name, workflow id, epoch)."""
    return [
        (c.name, e["id"], e["epoch"])
        for c in configs
        for e in read_journal(c.journal)
        if e["ev"] == "drive"
    ]


def _owners(storage: Storage, ids: list[str]) -> dict[str, tuple[str | None, int | None]]:
    found: dict[str, tuple[str | None, int | None]] = {}
    for wid in ids:
        holder = decode_holder(storage.get(keys.workflow_owner_holder(wid)))
        epoch = decode_epoch(storage.get(keys.workflow_owner_epoch(wid)) or b"")
        found[wid] = (None if holder is None else holder.engine_id, epoch)
    return found


def test_a_killed_engines_workflows_are_driven_by_the_rest_of_the_fleet(
    storage_url: str, open_store, tmp_path: Path
) -> None:
    ids = [f"job-{n:03d}" for n in range(WORKFLOWS)]
    configs = [_config(tmp_path, storage_url, 0, ids)] + [
        _config(tmp_path, storage_url, n, []) for n in range(1, ENGINES)
    ]
    processes = []
    try:
        deadline = time.monotonic() + 120
        engine_ids = {}
        # The victim first and alone: the fleet joins an engine that is already running.
        processes.append(spawn(run_engine, configs[0], configs[0].name))
        engine_ids["engine-0"] = _engine_when_ready(configs[0], processes[0], deadline)
        processes += [spawn(run_engine, c, c.name) for c in configs[1:]]
        for config, process in zip(configs[1:], processes[1:], strict=True):
            engine_ids[config.name] = _engine_when_ready(config, process, deadline)
        store = open_store()
        victim = engine_ids["engine-0"]
        assert set(_owners(store, ids).values()) == {(victim, 1)}
        sigkill(processes[0], "engine-0")
        killed_at = time.monotonic()
        survivors = {engine_ids[c.name]: c for c in configs[1:]}
        while True:
            owners = _owners(store, ids)
            driven = {
                wid
                for c in configs[1:]
                for e in read_journal(c.journal)
                if e["ev"] == "drive"
                for wid in [e["id"]]
            }
            forgotten = store.get(keys.engine_liveness(victim)) is None
            if all(o in survivors for o, _ in owners.values()) and driven >= set(ids) and forgotten:
                final = owners
                break
            assert time.monotonic() - killed_at < DEADLINE_S, (
                f"{sum(o not in survivors for o, _ in owners.values())} workflows still held "
                f"by the dead engine or nobody, {len(set(ids) - driven)} not driven, dead "
                f"engine's record {'gone' if forgotten else 'still there'}"
            )
            time.sleep(POLL_S)
        # What the takeover did, read before the fleet stops: an engine that closes releases
        # its running workflows, which the engines still open then acquire and drive anew.
        drives = _drives(configs[1:])
        last_driver = {wid: name.encode() for name, wid, _ in drives}
        with Ownership.open(store, background="manual") as reader:
            while True:  # a drive is journaled before its checkpoint is written
                checkpoints = {wid: reader.workflows.load_checkpoint(wid) for wid in ids}
                if checkpoints == last_driver:
                    break
                assert time.monotonic() - killed_at < DEADLINE_S, "checkpoints not written"
                time.sleep(POLL_S)
        stop_all(processes[1:], Path(configs[0].stop))
    finally:
        stop_all([p for p in processes if p.is_alive()], Path(configs[0].stop))
    for config in configs:
        assert journal_errors(config.journal) == [], config.name
    redriven = [d for d in _drives(configs[1:]) if d not in drives]
    assert all(epoch > 2 for _, _, epoch in redriven), redriven  # acquired after a release
    # Every workflow was taken over once (epoch 2) and driven once, by the engine that won it.
    assert sorted(wid for _, wid, _ in drives) == sorted(ids)
    assert {epoch for _, _, epoch in drives} == {2}
    by_name = {c.name: engine_id for engine_id, c in survivors.items()}
    for name, wid, _ in drives:
        assert final[wid] == (by_name[name], 2)
    for name, wid, _ in drives:
        assert checkpoints[wid] == name.encode()
    shares = Counter(name for name, _, _ in drives)
    # Fair shares: many survivors took part, none took the lion's share.
    assert len(shares) >= 4, shares
    assert max(shares.values()) <= math.ceil(WORKFLOWS / 2), shares
    # Nothing is left indexed under the dead engine, and its record is gone or closed out.
    prefix = keys.workflow_owner_by_engine_prefix(victim)
    assert store.scan(prefix) == []
