"""Engine processes append to their workflows' rows in the host's own table, through the fence.

Each contender is a spawned interpreter with its own :class:`~weft_sync.Ownership` (interval
renewal and reclaim, wall clock) and one host connection to the store's database. It walks the
workflow ids at random: it acquires or takes over ids it does not hold, and for an id it holds it
appends ``"<epoch>:<engine>:<seq>;"`` to that workflow's ``history`` column with one fenced
``UPDATE``; now and then it releases. The driver (:func:`run_contention`) freezes contenders
with SIGSTOP (sometimes past the claim TTL, sometimes inside a fenced transaction), resumes them
with SIGCONT and SIGKILLs one of them. Afterwards :func:`check_histories` requires of every
workflow's history that its epochs never go down and that each epoch was written by one engine.

Used by ``tests/fencing/test_host_contention.py`` (a short run) and by
``bench/fenced_contention.py`` (the long one).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from tests.integration.procs import (
    Journal,
    log_warnings_to,
    read_journal,
    run_journaled,
    spawn,
    stop_all,
    wait_for_go,
    wait_ready,
)
from weft_sync import Ownership, OwnershipOptions
from weft_sync.claims import AcquireStatus, TakeoverStatus
from weft_sync.errors import EngineDeposedError, StorageError, WeftError

TTL_MS = 900
RENEW_MS = 300
TABLE = "fence_history"
EXTRA_S = 30.0


@dataclass(frozen=True)
class ContenderConfig:
    backend: str
    storage_url: str
    db_url: str
    table: str
    engine_id: str
    workflow_ids: tuple[str, ...]
    journal_path: str
    log_path: str
    go_path: str
    stop_path: str
    max_duration_s: float
    seed: int


def _connect(config: ContenderConfig) -> Any:
    if config.backend == "sqlite":
        return sqlite3.connect(config.db_url, timeout=5.0, isolation_level=None)
    return psycopg.connect(config.db_url)


def _append(config: ContenderConfig, conn: Any, wid: str, entry: str) -> None:
    if config.backend == "sqlite":
        sql = f"UPDATE {config.table} SET history = history || ? WHERE id = ?"
        conn.execute(sql, (entry, wid))
    else:
        sql = f"UPDATE {config.table} SET history = history || %s WHERE id = %s"
        conn.execute(sql, (entry, wid))


def run_contender(config: ContenderConfig) -> None:
    """Entry point of a contender process."""
    run_journaled(config.journal_path, lambda journal: _contend(config, journal))


def _contend(config: ContenderConfig, journal: Journal) -> None:
    log_warnings_to(config.log_path)
    options = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
    counts: Counter[str] = Counter()
    rng = random.Random(config.seed)
    with Ownership.open(
        config.storage_url, options=options, warn=lambda w: None, engine_id=config.engine_id
    ) as own:
        conn = _connect(config)
        journal.write({"ev": "ready", "pid": os.getpid()})
        wait_for_go(config.go_path, 60.0, 0.005)
        deadline = time.monotonic() + config.max_duration_s
        seq = 0
        while not os.path.exists(config.stop_path) and time.monotonic() < deadline:
            held = own.registry.list_held_workflow_ids()
            wid = (
                rng.choice(held) if held and rng.random() < 0.7 else rng.choice(config.workflow_ids)
            )
            epoch = own.registry.current_epoch(wid)
            try:
                if epoch is None:
                    status: AcquireStatus | TakeoverStatus = own.registry.takeover(wid).status
                    if status == "no-claim":
                        status = own.registry.acquire(wid).status
                    counts[f"claim_{status}"] += 1
                elif rng.random() < 0.1:
                    counts[f"release_{own.registry.release(wid, epoch).status}"] += 1
                else:
                    seq += 1
                    with own.fenced(wid, conn):
                        _append(config, conn, wid, f"{epoch}:{config.engine_id}:{seq};")
                        if rng.random() < 0.1:
                            # Linger with the transaction open, so signals land inside it too.
                            time.sleep(0.05)
                    counts["fenced_committed"] += 1
            except EngineDeposedError:
                counts["fenced_refused"] += 1
            except (StorageError, WeftError, sqlite3.Error, psycopg.Error) as exc:
                # The fence's own statements (BEGIN, the epoch read) raise StorageError with
                # the driver's error as its cause; the host's statements and COMMIT raise the
                # driver's error. Either way a connection the server ended (a session frozen
                # inside its transaction) is replaced.
                driver = exc if isinstance(exc, (sqlite3.Error, psycopg.Error)) else exc.__cause__
                if isinstance(driver, (sqlite3.Error, psycopg.Error)):
                    counts[f"host_{type(driver).__name__}"] += 1
                    conn.close()
                    conn = _connect(config)
                else:
                    counts[f"error_{type(exc).__name__}"] += 1
        conn.close()
    journal.write({"ev": "summary", "counts": dict(counts)})


# -- driver -----------------------------------------------------------------------------------


@dataclass
class ContentionResult:
    entries: int
    handed_over: int
    """Workflows whose history has entries of at least two epochs."""
    counts: Counter[str]
    signals: Counter[str]


def _setup_table(backend: str, db_url: str, table: str, ids: list[str]) -> None:
    create = f"CREATE TABLE {table} (id TEXT PRIMARY KEY, history TEXT NOT NULL)"
    if backend == "sqlite":
        with sqlite3.connect(db_url) as conn:
            conn.execute(create)
            conn.executemany(f"INSERT INTO {table} VALUES (?, '')", [(i,) for i in ids])
        conn.close()
    else:
        with psycopg.connect(db_url) as pconn:
            pconn.execute(create)
            pconn.cursor().executemany(f"INSERT INTO {table} VALUES (%s, '')", [(i,) for i in ids])


def read_histories(backend: str, db_url: str, table: str) -> dict[str, str]:
    sql = f"SELECT id, history FROM {table}"
    if backend == "sqlite":
        with sqlite3.connect(db_url) as conn:
            rows = conn.execute(sql).fetchall()
        conn.close()
    else:
        with psycopg.connect(db_url) as pconn:
            rows = pconn.execute(sql).fetchall()
    return {str(k): str(v) for k, v in rows}


def check_histories(histories: dict[str, str]) -> tuple[int, int]:
    """Assert epochs never go down and one engine writes each epoch; return (entries, handed
    over)."""
    entries = handed_over = 0
    for wid, history in histories.items():
        parsed = [item.split(":") for item in history.split(";") if item]
        epochs = [int(e) for e, _, _ in parsed]
        assert epochs == sorted(epochs), (
            f"a lower epoch wrote after a higher one in {wid}: {epochs}"
        )
        writers: defaultdict[int, set[str]] = defaultdict(set)
        for e, engine, _ in parsed:
            writers[int(e)].add(engine)
        shared = {e: w for e, w in writers.items() if len(w) > 1}
        assert not shared, f"several engines wrote under one epoch of {wid}: {shared}"
        entries += len(parsed)
        handed_over += len(writers) > 1
    return entries, handed_over


def run_contention(
    *,
    backend: str,
    storage_url: str,
    db_url: str,
    tmp_path: Path,
    processes: int,
    workflows: int,
    duration_s: float,
    seed: int = 7,
) -> ContentionResult:
    """Run the contest and check it; the host table is created here and dropped on PostgreSQL."""
    ids = [f"wf-{n:03d}" for n in range(workflows)]
    table = f"{TABLE}_{os.getpid()}_{seed}"
    _setup_table(backend, db_url, table, ids)
    go, stop = tmp_path / "go", tmp_path / "stop"
    configs = [
        ContenderConfig(
            backend,
            storage_url,
            db_url,
            table,
            f"engine-{n}",
            tuple(ids),
            str(tmp_path / f"engine-{n}.jsonl"),
            str(tmp_path / f"engine-{n}.log"),
            str(go),
            str(stop),
            duration_s + EXTRA_S + 30.0,
            seed * 100 + n,
        )
        for n in range(processes)
    ]
    procs = [spawn(run_contender, c, c.engine_id) for c in configs]
    signals: Counter[str] = Counter()
    try:
        deadline = time.monotonic() + 60.0
        for config in configs:
            wait_ready(config.engine_id, config.journal_path, deadline, 0.02, lambda: None)
        go.touch()

        def contended() -> bool:
            histories = read_histories(backend, db_url, table)
            return any(len(set(_epochs(h))) > 1 for h in histories.values())

        _disturb(procs, duration_s, random.Random(seed), signals, contended)
    finally:
        stop_all(procs, stop)
    counts: Counter[str] = Counter()
    for config, proc in zip(configs, procs, strict=True):
        events = read_journal(config.journal_path)
        errors = [e["traceback"] for e in events if e["ev"] == "error"]
        assert not errors, f"{config.engine_id} failed:\n{errors[0]}"
        for event in events:
            if event["ev"] == "summary":
                counts.update(event["counts"])
        if proc.exitcode != -signal.SIGKILL:
            assert proc.exitcode == 0, f"{config.engine_id} exited with {proc.exitcode}"
    try:
        entries, handed_over = check_histories(read_histories(backend, db_url, table))
    finally:
        if backend == "postgres":
            with psycopg.connect(db_url, autocommit=True) as pconn:
                pconn.execute(f"DROP TABLE IF EXISTS {table}")
    return ContentionResult(entries, handed_over, counts, signals)


def _epochs(history: str) -> list[str]:
    return [item.split(":")[0] for item in history.split(";") if item]


def _disturb(
    procs: list[Any],
    duration_s: float,
    rng: random.Random,
    signals: Counter[str],
    contended: Callable[[], bool],
) -> None:
    """SIGSTOP/SIGCONT contenders at random for ``duration_s``; SIGKILL one halfway.

    A slow machine (a freeze that lands while a contender holds SQLite's write lock stalls every
    other one) can spend the whole window without a workflow changing owner. The disturbance then
    goes on, without another kill, until some history holds two epochs or ``EXTRA_S`` more
    seconds have passed; the test then fails saying nothing contended.
    """
    end = time.monotonic() + duration_s
    give_up = end + EXTRA_S
    killed = False
    while True:
        now = time.monotonic()
        if now >= end and (now >= give_up or contended()):
            break
        time.sleep(rng.uniform(0.05, 0.2))
        live = [p for p in procs if p.is_alive()]
        if not killed and time.monotonic() > end - duration_s / 2 and len(live) > 1:
            victim = rng.choice(live)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            signals["SIGKILL"] += 1
            killed = True
            continue
        frozen = rng.choice(live)
        os.kill(frozen.pid, signal.SIGSTOP)
        signals["SIGSTOP"] += 1
        # Sometimes past the claim TTL plus grace: the claims are taken over meanwhile.
        time.sleep(
            rng.choice((0.05, (TTL_MS + 3 * RENEW_MS) / 1000, (TTL_MS + 3 * RENEW_MS) / 1000))
        )
        os.kill(frozen.pid, signal.SIGCONT)
