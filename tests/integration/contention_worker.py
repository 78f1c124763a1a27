"""Child side of the fenced-contention test: engines that fight over workflows and log through
the epoch fence.

Each contender is a spawned interpreter with its own engine (bootstrap, interval renewal with the
reclaim target). For a fixed time it picks workflow ids at random and acquires, takes over,
writes log entries under the epoch it holds, releases, and now and then replays a write with an
epoch it held before, once the store shows that epoch has moved on.

A log entry is appended with one compare-and-swap that requires the workflow's epoch key to equal
the writer's epoch and the log head to be the value just read, so the log of each workflow is a
gap-free sequence.

Contenders talk to the test only through files (see :mod:`tests.integration.procs`): a journal
each, a "go" file the test creates once every contender is ready and a "stop" file that ends the
contest.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Final

from tests.integration.procs import Journal, log_warnings_to, run_journaled, wait_for_go
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import system_clock
from weft_sync.codec import decode_epoch
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.storage import Condition, Put, Storage, open_storage

__all__ = [
    "ContenderConfig",
    "LogEntry",
    "append_log_entry",
    "decode_log_entry",
    "decode_log_head",
    "log_entry_key",
    "log_entry_prefix",
    "log_head_key",
    "run_contender",
]

_GO_TIMEOUT_S: Final = 60.0
_GO_POLL_S: Final = 0.005
_CLOSE_TIMEOUT_S: Final = 10.0
_OWN_SHARE: Final = 0.6
"""Share of the turns spent on a workflow this engine holds; the rest pick any workflow."""
_WRITE_SHARE: Final = 0.7
"""Share of the turns on a held workflow that append entries; the rest release it."""
_STALE_SHARE: Final = 0.15
"""Share of the turns that also replay a write with an epoch held before."""
_MAX_ENTRIES_PER_TURN: Final = 3


@dataclass(frozen=True)
class ContenderConfig:
    """Everything one contender process needs (pickled across the ``spawn`` boundary)."""

    storage_url: str
    engine_id: str
    workflow_ids: tuple[str, ...]
    journal_path: str
    log_path: str
    go_path: str
    stop_path: str
    max_duration_s: float
    claim_ttl_ms: int
    claim_renew_interval_ms: int
    seed: int


@dataclass(frozen=True)
class LogEntry:
    """One entry of a workflow's log: who wrote it, under which epoch, at which position."""

    worker: str
    epoch: int
    seq: int
    stale: bool


def log_head_key(workflow_id: str) -> str:
    """The key holding the number of entries in ``workflow_id``'s log."""
    return "contention-head:" + keys.encode_key_component(workflow_id)


def log_entry_prefix(workflow_id: str) -> str:
    """The prefix shared by every entry key of ``workflow_id``'s log."""
    return "contention-log:" + keys.encode_key_component(workflow_id) + ":"


def log_entry_key(workflow_id: str, seq: int) -> str:
    """The key of entry ``seq`` (0-based) of ``workflow_id``'s log."""
    return f"{log_entry_prefix(workflow_id)}{seq:08d}"


def decode_log_head(raw: bytes | None) -> int:
    """The entry count a head value records; an absent head means an empty log."""
    if raw is None:
        return 0
    (count,) = struct.unpack(">Q", raw)
    return int(count)


def _encode_log_head(count: int) -> bytes:
    return struct.pack(">Q", count)


def decode_log_entry(raw: bytes) -> LogEntry:
    """Parse a stored log entry."""
    fields = json.loads(raw)
    return LogEntry(
        str(fields["worker"]), int(fields["epoch"]), int(fields["seq"]), bool(fields["stale"])
    )


def append_log_entry(
    storage: Storage,
    workflow_id: str,
    *,
    worker: str,
    epoch: int,
    token: bytes,
    stale: bool,
    journal: Journal,
) -> bool:
    """Append one entry to ``workflow_id``'s log, fenced on ``token`` (the epoch-key bytes of
    ``epoch`` as this worker minted them); ``False`` if refused.

    The intent is journaled before the write and the outcome after it, so a process killed in
    between leaves exactly one unresolved intent.
    """
    head_key = log_head_key(workflow_id)
    observed = storage.get(head_key)
    seq = decode_log_head(observed)
    entry = LogEntry(worker, epoch, seq, stale)
    journal.write({"ev": "intent", "wf": workflow_id, **asdict(entry)})
    committed = storage.conditional_batch(
        [
            Condition(keys.workflow_owner_epoch(workflow_id), token),
            Condition(head_key, observed),
        ],
        [
            Put(log_entry_key(workflow_id, seq), json.dumps(asdict(entry)).encode()),
            Put(head_key, _encode_log_head(seq + 1)),
        ],
    )
    journal.write({"ev": "ok" if committed else "refused", "wf": workflow_id, "seq": seq})
    return committed


def run_contender(config: ContenderConfig) -> None:
    """Entry point of a contender process; journals a traceback before re-raising any error."""
    run_journaled(config.journal_path, lambda journal: _contend(config, journal))


def _contend(config: ContenderConfig, journal: Journal) -> None:
    log_warnings_to(config.log_path)
    storage = open_storage(config.storage_url)
    lost: list[Warning] = []
    ownership = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=system_clock,
        claim_ttl_ms=config.claim_ttl_ms,
        claim_renew_interval_ms=config.claim_renew_interval_ms,
        warn=lost.append,
        engine_id=config.engine_id,
    )
    journal.write({"ev": "ready", "pid": os.getpid()})
    wait_for_go(config.go_path, _GO_TIMEOUT_S, _GO_POLL_S)
    ownership.renewal_task.start()
    contender = _Contender(config, ownership.registry, storage, journal)
    deadline = time.monotonic() + config.max_duration_s
    try:
        while not os.path.exists(config.stop_path) and time.monotonic() < deadline:
            contender.turn()
    finally:
        closed = ownership.renewal_task.close(timeout=_CLOSE_TIMEOUT_S)
        ownership.registry.release_all()
    counts = dict(contender.counts)
    counts["lost_warnings"] = len(lost)
    counts["task_closed"] = int(closed)
    counts["stopped_by_file"] = int(os.path.exists(config.stop_path))
    journal.write(
        {"ev": "summary", "counts": counts, "attempts": ownership.metrics.snapshot().attempts}
    )
    storage.close()


class _Contender:
    """The random walk of one contender over the workflow ids (single-threaded)."""

    def __init__(
        self, config: ContenderConfig, registry: ClaimRegistry, storage: Storage, journal: Journal
    ) -> None:
        self._config = config
        self._registry = registry
        self._storage = storage
        self._journal = journal
        self._rng = random.Random(config.seed)
        # (workflow, epoch) -> the epoch token this engine held it at.
        self._held_before: dict[tuple[str, int], bytes] = {}
        self.counts: Counter[str] = Counter()

    def turn(self) -> None:
        """Work on a held workflow or try to claim any; sometimes replay a stale write."""
        held = self._registry.list_held_workflow_ids()
        if held and self._rng.random() < _OWN_SHARE:
            workflow_id = self._rng.choice(held)
        else:
            workflow_id = self._rng.choice(self._config.workflow_ids)
        # Read afresh: the renewal task may have dropped the claim since the listing.
        epoch = self._registry.current_epoch(workflow_id)
        token = self._registry.current_epoch_bytes(workflow_id)
        if epoch is None or token is None:
            self._claim(workflow_id)
        else:
            self._held_before[workflow_id, epoch] = token
            if self._rng.random() < _WRITE_SHARE:
                self._write(workflow_id, epoch, token)
            else:
                status = self._registry.release(workflow_id, expected_epoch=epoch).status
                self.counts[f"release_{status}"] += 1
        if self._rng.random() < _STALE_SHARE:
            self._replay_stale_write()

    def _claim(self, workflow_id: str) -> None:
        if self._rng.random() < 0.5:
            takeover = self._registry.takeover(workflow_id)
            self.counts[f"takeover_{takeover.status}"] += 1
            if takeover.status != "no-claim":
                return
        acquire = self._registry.acquire(workflow_id)
        self.counts[f"acquire_{acquire.status}"] += 1

    def _write(self, workflow_id: str, epoch: int, token: bytes) -> None:
        for _ in range(self._rng.randint(1, _MAX_ENTRIES_PER_TURN)):
            if not self._append(workflow_id, epoch, token, stale=False):
                # Only the holder of an epoch writes under it, so a refusal means deposed.
                self.counts["fenced_refused"] += 1
                return
            self.counts["fenced_accepted"] += 1

    def _replay_stale_write(self) -> None:
        """Write with an epoch this engine held before, once the store shows a newer one."""
        if not self._held_before:
            return
        workflow_id, epoch = self._rng.choice(list(self._held_before))
        if self._registry.current_epoch(workflow_id) == epoch:
            return
        current = decode_epoch(self._storage.get(keys.workflow_owner_epoch(workflow_id)))
        if current is None or current <= epoch:
            # Released and not claimed since: that epoch is still the store's current one.
            return
        token = self._held_before.pop((workflow_id, epoch))
        if self._append(workflow_id, epoch, token, stale=True):
            self.counts["stale_accepted"] += 1
        else:
            self.counts["stale_refused"] += 1

    def _append(self, workflow_id: str, epoch: int, token: bytes, *, stale: bool) -> bool:
        return append_log_entry(
            self._storage,
            workflow_id,
            worker=self._config.engine_id,
            epoch=epoch,
            token=token,
            stale=stale,
            journal=self._journal,
        )
