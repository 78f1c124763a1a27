"""Chaos with restores: older copies of the store restored in place under killed and paused workers.

The fleet and the chaos of :mod:`tests.integration.test_chaos` (six spawned workers driving
workflows through fenced steps, one SIGKILLed every half second, one frozen now and then), with
one more fault: the test copies the store every ``SNAPSHOT_EVERY_S`` and, ``RESTORES`` times,
restores a copy 1.6 to 6 seconds old in place while the workers run. On SQLite the copy is
written into the live file through SQLite's backup API, what ``sqlite3 store.db ".restore
copy.db"`` does: the same file, inode and store id, the pages replaced in one write transaction
of the WAL, so every connection's next read sees the older store whole. (A byte copy over a file
in use cannot be that: frames a writer appends to the WAL between the checkpoint and the copy
would be replayed over the copy, and in WAL mode no connection re-reads pages it cached when the
main file changes under it.) On PostgreSQL the table's rows are replaced by a copy taken earlier
(``DELETE`` + ``INSERT … SELECT`` in one transaction, under the engines' row locks).

Each restore is the issue's case: a worker is frozen while its driver works on a workflow, the
copy restored is one that has that workflow one epoch back (or not yet started), an engine of
the test's own (:class:`_Reminter`) claims it at once — minting the frozen worker's epoch number
a second time — and releases it, and the worker runs on: its next write (a checkpoint, a fenced
write with no base condition, comes first in every step) names a token whose number the store
now gives another owner. The other workers meanwhile notice the restore on their own, or not.
After each restore the workers walk the id list again and start every workflow whose record the
restore took away; every other workflow the restore sent back in time is reclaimed and driven
again from its restored step counter, so all of them must still end ``completed``.

The store's own history is no evidence here: a restore rolls it back. What the check trusts is
recorded where no restore reaches: each worker's journal (every claim, accepted write and replay
with the exact token bytes it was made under and when, on the machine's monotonic clock) and
the test's log of copies and restores (each copy's tokens, read from the copy, and when it was
taken or restored). From them it builds, per workflow, *observations* "the store's epoch key
held token T at some moment in [lo, hi]": a mint (T is current right after its claim commits),
an accepted fenced write (the fence let it through, so T was current when it committed), a copy
(its tokens at the moment it was read), a restore (the copy's token from its commit on) and the
final store.

**A violation** is either of:

- **a token coming back**: observations O1 < O2 < O3 (each one's interval wholly before the next
  one's) where O1 and O3 show token T and O2 another one (or no epoch key), with no restore of
  a copy holding T for that workflow that could have committed between O2 and O3. Minting only
  ever writes a token never seen before, so once T was superseded only a restore brings it back:
  such an O3 is a write accepted under a superseded token, or a write under a token the store
  forgot (minted before a restore that rolled the workflow back to another token, accepted
  after it: the fence compared an epoch number a new owner minted a second time) — or a store
  that went back in time by itself.
- **two owners of one token**: writes accepted under one token from two engines, or a token
  that two engines' journals show them holding.

A write whose token is unknown (the registry's token changed while it was in flight) is left
out and counted. After the checks the run must show what it claims: the restores, a claim lost
with cause ``store_rollback``, a step written again after a restore rolled it back, and a write
refused because its epoch number had been minted a second time (its token had not). It prints
its numbers in one line.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.integration.chaos_fleet import (
    Chaos,
    ChaosSettings,
    Fleet,
    FleetSettings,
    Incarnation,
    driving,
    open_fleet,
    wait_all_completed,
)
from tests.integration.chaos_worker import (
    WORKFLOW_TYPE,
    StepEntry,
    counter_key,
    decode_counter,
    decode_step_entry,
    step_prefix,
)
from tests.integration.procs import tokens
from weft_sync import keys
from weft_sync.codec import decode_epoch
from weft_sync.errors import StorageError, WeftError, WorkflowClaimUnavailableError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage, open_storage
from weft_sync.workflows import Workflows

WORKERS = 6
WORKFLOWS = 300
STEPS = 5
SNAPSHOT_EVERY_S = 0.7
RESTORES = 5
FIRST_RESTORE_S = 3.0
RESTORE_EVERY_S = 2.5
"""When restores are due: seconds into the chaos, then after the previous one."""
RESTORE_AGE_S = (1.6, 6.0)
"""How old the restored copy is: older than the claim TTL plus two renew intervals, so the
claims it holds are expired as soon as it is back."""
RESTORE_LOCK_WAIT_S = 0.5
"""A restore that waits longer for the store's locks (a frozen worker may hold them) is given
up and tried again a little later."""
RESTORE_PATIENCE_S = 1.0
"""How long a due restore waits for a worker it can freeze across it."""
FREEZE_LOCK_WAIT_S = 0.1
"""A worker frozen for a restore while SQLite's write lock stays taken is let go at once."""
REMINTER = "reminter"
RESTORE_RETRY_S = 0.2
CHAOS_MIN_S = 14.0
CHAOS_MAX_S = 30.0
COMPLETE_TIMEOUT_S = 60.0

FLEET = FleetSettings(
    workers=WORKERS,
    steps=STEPS,
    step_work_s=0.03,
    claim_ttl_ms=900,
    claim_renew_interval_ms=300,
    worker_max_s=170.0,
    ready_timeout_s=60.0,
    poll_s=0.05,
    rewalk=True,
    checkpoint_steps=True,
    drive_blocks=True,
)
CHAOS = ChaosSettings(
    kill_every_s=0.5,
    first_pause_s=1.0,
    pause_every_s=3.0,
    pause_max_s=4.0,
    resume_grace_s=1.5,
    journal_poll_s=0.5,
    poll_s=0.05,
)

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(180)]

_EPOCH_PREFIX = keys.workflow_owner_epoch("")
_BUSY = (5, 6)
"""SQLITE_BUSY and SQLITE_LOCKED: a backup step that could not lock the file."""


def _now() -> int:
    return time.monotonic_ns()


# -- copies of the store, and restoring them in place ----------------------------------------


class _Copies(Protocol):
    """Takes copies of the live store and restores one of them in place."""

    def take(self, index: int) -> tuple[str, dict[str, bytes]]:
        """Copy the store; return the copy's name and its ``{workflow id: token}``."""

    def restore(self, name: str, wait_s: float) -> bool:
        """Replace the live store's content by the copy's; ``False``: locks not had in time."""

    def writable(self, wait_s: float) -> bool:
        """Whether a write could begin within ``wait_s`` (no one sits on a store-wide lock)."""

    def close(self) -> None: ...


def _epoch_rows(rows: list[tuple[str, bytes]]) -> dict[str, bytes]:
    return {keys.decode_key_component(k[len(_EPOCH_PREFIX) :]): bytes(v) for k, v in rows}


class _SqliteCopies:
    """Copies through SQLite's backup API, in both directions.

    A copy is read from the live file in one read transaction; a restore writes the copy's pages
    into the live file in one write transaction (``sqlite3 store.db ".restore copy.db"``).
    """

    def __init__(self, path: Path, table: str, folder: Path) -> None:
        self._path = path
        self._table = table
        self._folder = folder

    def take(self, index: int) -> tuple[str, dict[str, bytes]]:
        name = str(self._folder / f"copy-{index}.db")
        with (
            closing(sqlite3.connect(self._path, timeout=10)) as src,
            closing(sqlite3.connect(name)) as dst,
        ):
            src.backup(dst)
            rows = dst.execute(
                f'SELECT key, value FROM "{self._table}" WHERE key >= ? AND key < ?',
                (_EPOCH_PREFIX, _EPOCH_PREFIX[:-1] + ";"),
            ).fetchall()
        return name, _epoch_rows(rows)

    def restore(self, name: str, wait_s: float) -> bool:
        inode = self._path.stat().st_ino
        deadline = time.monotonic() + wait_s

        def give_up(status: int, remaining: int, total: int) -> None:
            if status in _BUSY and time.monotonic() > deadline:
                raise TimeoutError

        with (
            closing(sqlite3.connect(name)) as src,
            closing(sqlite3.connect(self._path, timeout=wait_s)) as dst,
        ):
            try:
                src.backup(dst, progress=give_up, sleep=0.01)
            except TimeoutError:
                return False
        assert self._path.stat().st_ino == inode, "the restore replaced the file"
        return True

    def writable(self, wait_s: float) -> bool:
        with closing(sqlite3.connect(self._path, timeout=wait_s)) as conn:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                return False
            conn.rollback()
        return True

    def close(self) -> None:
        pass


class _PostgresCopies:
    """Copies as tables beside the store's; a restore replaces the store table's rows."""

    def __init__(self, base_url: str, table: str) -> None:
        self._base = base_url
        self._table = table
        self._copies: list[str] = []

    def take(self, index: int) -> tuple[str, dict[str, bytes]]:
        import psycopg

        name = f"{self._table}_copy{index}"
        with psycopg.connect(self._base, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{name}" AS SELECT * FROM "{self._table}"')
            self._copies.append(name)
            rows = conn.execute(
                f'SELECT key, value FROM "{name}" WHERE key LIKE %s', (_EPOCH_PREFIX + "%",)
            ).fetchall()
        return name, _epoch_rows(rows)

    def restore(self, name: str, wait_s: float) -> bool:
        import psycopg

        try:
            with psycopg.connect(self._base) as conn, conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = {int(wait_s * 1000)}")
                # Writers wait for the restore (readers do not): without the table lock an
                # engine's insert committed between the DELETE and the INSERT collides with
                # the copy's row for the same key.
                conn.execute(f'LOCK TABLE "{self._table}" IN EXCLUSIVE MODE')
                conn.execute(f'DELETE FROM "{self._table}"')
                conn.execute(f'INSERT INTO "{self._table}" SELECT * FROM "{name}"')
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
            return False
        return True

    def writable(self, wait_s: float) -> bool:
        # Row locks only: a frozen worker's transaction holds up the rows it locked, and the
        # server ends it once it sat idle in the transaction for two renew intervals.
        return True

    def close(self) -> None:
        import psycopg

        with psycopg.connect(self._base, autocommit=True) as conn:
            for name in self._copies:
                conn.execute(f'DROP TABLE IF EXISTS "{name}"')


@dataclass(frozen=True)
class _Copy:
    index: int
    name: str
    lo: int
    hi: int
    """Monotonic ns around the copy: it shows the store at one moment in between."""
    taken_s: float
    tokens: dict[str, bytes]


@dataclass(frozen=True)
class _Restore:
    copy: _Copy
    lo: int
    hi: int
    """Monotonic ns around the restore: it committed at one moment in between."""
    paused: bool
    """Whether a worker was frozen across it (it wakes holding claims the store forgot)."""
    reminted: bool
    """Whether the epoch number of the frozen worker's driven claim was minted again."""


class _Reminter:
    """An engine of the test's own that mints, right after a restore, the epoch number a frozen
    worker still holds: the issue's case made certain rather than left to the reclaim passes.

    It claims the workflow (takes it over, resumes it, or starts it again when the restore took
    its record away) and releases it at once, so the fleet drives it on. It never writes
    anything else, so its mints are observations like any worker's claim.
    """

    def __init__(self, url: str) -> None:
        self._storage = open_storage(url)
        self._own = Ownership.open(
            self._storage,
            engine_id=REMINTER,
            options=OwnershipOptions(
                claim_ttl=FLEET.claim_ttl_ms, claim_renew_interval=FLEET.claim_renew_interval_ms
            ),
            background="manual",
            warn=lambda warning: None,
        )
        self.mints: list[tuple[str, bytes, int, int]] = []
        """``(workflow id, token, lo, hi)`` of every mint, in monotonic ns."""

    def remint(self, wid: str) -> bool:
        """Claim ``wid`` (a fresh epoch), then release it; ``False``: it could not be claimed."""
        workflows, registry = self._own.workflows, self._own.registry
        lo = _now()
        try:
            if workflows.get(wid) is None:
                workflows.start(wid, WORKFLOW_TYPE, input={"engine": REMINTER})
            else:
                try:
                    workflows.resume(wid)
                except WorkflowClaimUnavailableError:
                    if registry.takeover(wid).status != "acquired":
                        return False
        except (WeftError, StorageError):
            return False
        token = registry.current_epoch_bytes(wid)
        hi = _now()
        if token is None:
            return False
        self.mints.append((wid, token, lo, hi))
        registry.release(wid)
        return True

    def close(self) -> None:
        self._own.close()
        self._storage.close()


@dataclass
class _Restorer:
    """Copies the store now and then, and restores an older copy every ``RESTORE_EVERY_S``.

    Each restore freezes a worker while its driver works on a workflow first, restores a copy
    that has that workflow one epoch back (or not yet started), has the reminter mint that
    epoch number again, and lets the worker run on: its next write is made under a token whose
    number the store now gives another owner.
    """

    copies: _Copies
    chaos: Chaos
    reminter: _Reminter
    rng: random.Random
    start_s: float
    taken: list[_Copy] = field(default_factory=list)
    done: list[_Restore] = field(default_factory=list)
    next_copy_s: float = 0.0
    next_restore_s: float = 0.0
    given_up: int = 0

    def __post_init__(self) -> None:
        self.next_restore_s = self.start_s + FIRST_RESTORE_S

    def tick(self, now: float) -> None:
        if now >= self.next_copy_s:
            self._take(now)
            self.next_copy_s = now + SNAPSHOT_EVERY_S
        if len(self.done) < RESTORES and now >= self.next_restore_s and self.chaos.pause is None:
            self._restore(now)

    def _take(self, now: float) -> None:
        lo = _now()
        name, found = self.copies.take(len(self.taken))
        self.taken.append(_Copy(len(self.taken), name, lo, _now(), now, found))

    def _restore(self, now: float) -> None:
        low, high = RESTORE_AGE_S
        fit = [c for c in self.taken if low <= now - c.taken_s <= high]
        if not fit:
            fit = [c for c in self.taken if now - c.taken_s >= low][-1:]
        if not fit:
            return
        frozen = self.chaos.freeze(now, _driving_held)
        if not frozen and now < self.next_restore_s + RESTORE_PATIENCE_S:
            return  # wait a little for a worker to freeze across it
        if frozen and not self.copies.writable(FREEZE_LOCK_WAIT_S):
            # It froze inside a write transaction, which stops every writer, not only itself.
            self.chaos.thaw()
            self.next_restore_s = time.monotonic() + RESTORE_RETRY_S
            return
        pause = self.chaos.pause
        driven = None if pause is None else pause.driving
        held = None if pause is None or driven is None else pause.held.get(driven)
        copy = max(fit, key=lambda c: (_one_back(driven, held, c.tokens), self.rng.random()))
        lo = _now()
        if not self.copies.restore(copy.name, RESTORE_LOCK_WAIT_S):
            if frozen:
                self.chaos.thaw()
            self.given_up += 1
            self.next_restore_s = time.monotonic() + RESTORE_RETRY_S
            return
        restore = _Restore(copy, lo, _now(), frozen, reminted=False)
        if frozen and driven is not None and _one_back(driven, held, copy.tokens):
            restore = replace(restore, reminted=self.reminter.remint(driven))
        if frozen:
            self.chaos.end_pause(time.monotonic())
        self.done.append(restore)
        self.next_restore_s = time.monotonic() + RESTORE_EVERY_S
        self.chaos.fleet.rewalk()


def _driving_held(found: list[Incarnation]) -> list[Incarnation]:
    """The workers whose driver works on a workflow they hold (as their journal says)."""
    return [inc for inc in found if driving(inc.journal()) is not None]


def _one_back(wid: str | None, held: bytes | None, copied: dict[str, bytes]) -> bool:
    """Whether the copy has ``wid`` one epoch before ``held`` (or, for epoch 1, not at all)."""
    epoch = None if held is None else decode_epoch(held)
    if wid is None or epoch is None:
        return False
    before = copied.get(wid)
    if before is None:
        return epoch == 1
    return decode_epoch(before) == epoch - 1


# -- the sites: a store of each backend and its copies ---------------------------------------


@dataclass
class _Site:
    url: str
    copies: _Copies


@pytest.fixture
def site(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Site]:
    table = "t_" + uuid.uuid4().hex[:16]
    if backend == "sqlite":
        path = tmp_path / "store.db"
        folder = tmp_path / "copies"
        folder.mkdir()
        copies: _Copies = _SqliteCopies(path, table, folder)
        url = f"sqlite:///{path}?table={table}"
    else:
        base: str = request.getfixturevalue("postgres_base_url")
        copies = _PostgresCopies(base, table)
        url = f"{base}{'&' if '?' in base else '?'}table={table}"
    try:
        yield _Site(url, copies)
    finally:
        copies.close()


# -- what the journals and the restore log say -----------------------------------------------


@dataclass(frozen=True)
class _Final:
    """The store once every worker stopped: its tokens, read between ``lo`` and ``hi``."""

    tokens: dict[str, bytes]
    lo: int
    hi: int
    ended: dict[str, _Ended]


Token = str | None
"""A fencing token as hex; ``None``: the workflow had no epoch key."""


@dataclass(frozen=True)
class _Seen:
    """The workflow's epoch key held ``token`` at some moment in ``[lo, hi]`` (monotonic ns)."""

    token: Token
    lo: int
    hi: int
    what: str


@dataclass(frozen=True)
class _Write:
    """One fenced write a journal saw accepted."""

    wf: str
    step: int | None
    """The step it wrote (``None``: a completion)."""
    engine: str
    token: str
    lo: int
    hi: int
    kind: str


@dataclass
class _History:
    """Every worker's journal and the restore log, folded into observations per workflow."""

    seen: dict[str, list[_Seen]] = field(default_factory=lambda: defaultdict(list))
    writes: list[_Write] = field(default_factory=list)
    holders: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """``{token: engines whose journal shows them holding it}``."""
    unresolved: dict[tuple[str, int], set[tuple[str, str]]] = field(
        default_factory=lambda: defaultdict(set)
    )
    """``{(workflow, step): {(engine, token)}}`` of writes that may or may not have landed."""
    stale_errors: set[tuple[str, str]] = field(default_factory=set)
    """``{(engine, workflow)}`` of replays whose outcome a store error hid."""
    ambiguous: int = 0
    counts: Counter[str] = field(default_factory=Counter)


def _fold_journal(history: _History, engine: str, events: list[dict[str, Any]]) -> None:
    """Add one incarnation's journal to ``history``."""
    intent: dict[str, Any] | None = None
    for event in events:
        kind = event["ev"]
        history.counts[kind] += 1
        token = event.get("token")
        if kind in ("start", "reclaimed", "drive", "intent", "checkpoint") and token is not None:
            history.holders[token].add(engine)
        if kind == "start" and token is not None:
            history.seen[event["wf"]].append(
                _Seen(token, event["t0"], event["t"], f"{engine} started it")
            )
        elif kind == "reclaimed" and token is not None:
            # The takeover committed before the callback; how long before is not known.
            history.seen[event["wf"]].append(_Seen(token, 0, event["t"], f"{engine} took it"))
        elif kind == "checkpoint":
            _accepted_checkpoint(history, engine, event)
        elif kind == "intent":
            intent = event
        elif kind in ("ok", "deposed", "conflict", "storage_error") and intent is not None:
            if kind == "ok":
                _accepted_step(history, engine, intent, event)
            elif kind == "storage_error" and intent["token"] is not None:
                history.unresolved[intent["wf"], intent["step"]].add((engine, intent["token"]))
            if kind == "deposed":
                _fold_refusal(history, event)
            intent = None
        elif kind == "deposed":
            _fold_refusal(history, event)
        elif kind == "completed" and token is not None:
            write = _Write(event["wf"], None, engine, token, event["t0"], event["t"], kind)
            _accepted(history, write)
        elif kind == "stale":
            _fold_replay(history, engine, event)
        elif kind == "stale_error":
            history.stale_errors.add((engine, event["wf"]))
        elif kind == "warning" and event.get("cause"):
            history.counts[f"lost_{event['cause']}"] += 1
    if intent is not None and intent["token"] is not None:
        # Killed inside the write: it may or may not have landed.
        history.unresolved[intent["wf"], intent["step"]].add((engine, intent["token"]))


def _fold_refusal(history: _History, event: dict[str, Any]) -> None:
    history.counts[f"refused_{event['cause']}"] += 1
    token, store = event.get("token"), event.get("store")
    if token is None or store in (None, "?", token):
        return
    if decode_epoch(bytes.fromhex(store)) == decode_epoch(bytes.fromhex(token)):
        # The store holds this writer's epoch number again, minted by another owner.
        history.counts["refused_reminted"] += 1


def _accepted_step(
    history: _History, engine: str, intent: dict[str, Any], ok: dict[str, Any]
) -> None:
    token, after = intent["token"], ok["after"]
    if token is None or (after is not None and after != token):
        # The registry's token changed while the write was in flight: which one the fence
        # named is not known.
        history.ambiguous += 1
        for candidate in (token, after):
            if candidate is not None:
                history.unresolved[intent["wf"], intent["step"]].add((engine, candidate))
        return
    _accepted(
        history,
        _Write(intent["wf"], intent["step"], engine, token, intent["t"], ok["t"], "step"),
    )


def _accepted_checkpoint(history: _History, engine: str, event: dict[str, Any]) -> None:
    token, after = event["token"], event["after"]
    if token is None or (after is not None and after != token):
        history.ambiguous += 1
        return
    write = _Write(event["wf"], event["step"], engine, token, event["t0"], event["t"], "checkpoint")
    _accepted(history, write)


def _fold_replay(history: _History, engine: str, event: dict[str, Any]) -> None:
    via, outcome = event["via"], event["outcome"]
    history.counts[f"replay_{via}_{outcome}"] += 1
    if outcome == "accepted" and event.get("token") is not None:
        what = f"replay through the {via}"
        step = event.get("step")
        write = _Write(event["wf"], step, engine, event["token"], event["t0"], event["t"], what)
        _accepted(history, write)
    if via == "store" and outcome == "refused":
        stale = decode_epoch(bytes.fromhex(event["token"]))
        if event["store_epoch"] == stale:
            # The store holds the stale epoch number again, minted by another owner.
            history.counts["replay_refused_reminted"] += 1


def _accepted(history: _History, write: _Write) -> None:
    history.writes.append(write)
    what = f"{write.engine} had a {write.kind} accepted" + (
        "" if write.step is None else f" (step {write.step})"
    )
    what += f" at {write.lo / 1e9:.3f}-{write.hi / 1e9:.3f} s"
    history.seen[write.wf].append(_Seen(write.token, write.lo, write.hi, what))


def _fold(fleet: Fleet, ids: list[str], restorer: _Restorer, final: _Final) -> _History:
    history = _History()
    for incarnation, events in fleet.events():
        _fold_journal(history, incarnation.name, events)
    for wid, minted, lo, hi in restorer.reminter.mints:
        history.holders[minted.hex()].add(REMINTER)
        history.seen[wid].append(_Seen(minted.hex(), lo, hi, "the reminter claimed it"))
    for copy in restorer.taken:
        for wid in ids:
            seen = _Seen(
                _hex(copy.tokens.get(wid)), copy.lo, copy.hi, f"copy {copy.index} shows it"
            )
            history.seen[wid].append(seen)
    for number, restore in enumerate(restorer.done):
        what = f"restore {number} (of copy {restore.copy.index}) put it back"
        for wid in ids:
            seen = _Seen(_hex(restore.copy.tokens.get(wid)), restore.lo, restore.hi, what)
            history.seen[wid].append(seen)
    for wid in ids:
        seen = _Seen(_hex(final.tokens.get(wid)), final.lo, final.hi, "the final store shows it")
        history.seen[wid].append(seen)
    return history


def _hex(token: bytes | None) -> Token:
    return None if token is None else token.hex()


# -- the checks ------------------------------------------------------------------------------


def _restores_of(restorer: _Restorer, wid: str) -> list[tuple[int, int, Token]]:
    return [(r.lo, r.hi, _hex(r.copy.tokens.get(wid))) for r in restorer.done]


def _tokens_come_back(
    wid: str, seen: list[_Seen], restores: list[tuple[int, int, Token]]
) -> list[str]:
    """Each observation of a token current again after another one, with no restore between
    that could have brought it back (see the module docstring)."""
    first_end: dict[Token, int] = {}
    for item in seen:
        first_end[item.token] = min(first_end.get(item.token, item.hi), item.hi)
    found = []
    for o3 in seen:
        # Of the observations of another token wholly before O3, the one that starts last
        # leaves the least room for O1 before it and for a restore after it.
        before = [o for o in seen if o.token != o3.token and o.hi < o3.lo]
        if not before:
            continue
        o2 = max(before, key=lambda o: o.lo)
        if first_end[o3.token] >= o2.lo:
            continue  # no observation of O3's token wholly before O2
        if any(token == o3.token and hi > o2.lo and lo < o3.hi for lo, hi, token in restores):
            continue  # a restore of a copy holding it may have brought it back
        o1 = min((o for o in seen if o.token == o3.token), key=lambda o: o.hi)
        found.append(
            f"{wid}: token {_short(o3.token)} was current when {o1.what}, then "
            f"{_short(o2.token)} when {o2.what}, and {_short(o3.token)} again when {o3.what} "
            f"({(o3.lo - o2.hi) / 1e6:.1f} ms later), with no restore of a copy holding it "
            f"in between: one of these writes was accepted under a token the store did not hold"
        )
    return found


def _short(token: Token) -> str:
    if token is None:
        return "<no epoch key>"
    epoch = decode_epoch(bytes.fromhex(token))
    return f"#{epoch}:{token[16:24]}"


def _two_owners(history: _History) -> list[str]:
    found = []
    for token, engines in history.holders.items():
        if len(engines) > 1:
            found.append(f"token {_short(token)} was held by {sorted(engines)}")
    writers: dict[str, set[str]] = defaultdict(set)
    for write in history.writes:
        writers[write.token].add(write.engine)
        if write.engine not in history.holders[write.token]:
            found.append(f"{write.engine} wrote {write.wf} under {_short(write.token)}, not its")
    found += [
        f"writes under {_short(t)} were accepted from {sorted(e)}"
        for t, e in writers.items()
        if len(e) > 1
    ]
    return found


def _violations(history: _History, restorer: _Restorer, ids: list[str]) -> list[str]:
    found = _two_owners(history)
    for wid in ids:
        found += _tokens_come_back(wid, history.seen[wid], _restores_of(restorer, wid))
    return found


def _redriven(history: _History, restorer: _Restorer) -> int:
    """Steps accepted again after a restore that certainly came after an earlier acceptance."""
    times: dict[tuple[str, int], list[_Write]] = defaultdict(list)
    for write in history.writes:
        if write.step is not None and write.kind == "step":
            times[write.wf, write.step].append(write)
    count = 0
    for writes in times.values():
        first = min(writes, key=lambda w: w.hi)
        if any(
            first.hi < r.lo and r.hi < w.lo for w in writes for r in restorer.done if w is not first
        ):
            count += 1
    return count


@dataclass(frozen=True)
class _Ended:
    """What the store holds for one workflow at the end."""

    status: str | None
    outcome: str | None
    counter: int
    entries: dict[int, StepEntry]


def _read_final(storage: Storage, ids: list[str]) -> _Final:
    ledger = Workflows(storage)
    lo = _now()
    found = tokens(storage)
    hi = _now()
    ended: dict[str, _Ended] = {}
    for wid in ids:
        record = ledger.get(wid)
        outcome = ledger.get_outcome(wid)
        rows = storage.scan(step_prefix(wid))
        ended[wid] = _Ended(
            None if record is None else record.status,
            None if outcome is None else outcome.status,
            decode_counter(storage.get(counter_key(wid))),
            {int(k[len(step_prefix(wid)) :]): decode_step_entry(v) for k, v in rows},
        )
    return _Final(found, lo, hi, ended)


def _assert_all_completed(final: _Final) -> None:
    """Every workflow completed, with every step stored; a step past the last one can only be
    a replay the fence let through (after a restore put its token back)."""
    for wid, item in final.ended.items():
        assert item.status == "completed", f"{wid} ended {item.status}"
        assert item.outcome == "completed", f"{wid} has the outcome {item.outcome}"
        assert item.counter == STEPS, f"{wid} ran {item.counter} steps, not {STEPS}"
        steps = sorted(item.entries)
        assert steps[:STEPS] == list(range(STEPS)), f"{wid} has steps {item.entries}"
        extra = [item.entries[step] for step in steps[STEPS:]]
        assert all(entry.stale for entry in extra), f"{wid} has steps {item.entries}"


def _assert_store_holds_only_journaled_writes(final: _Final, history: _History) -> None:
    """Every step entry at the end is a write some journal saw accepted or left unresolved."""
    accepted: dict[tuple[str, int], set[tuple[str, str]]] = defaultdict(set)
    for write in history.writes:
        if write.step is not None and write.kind != "checkpoint":
            accepted[write.wf, write.step].add((write.engine, write.token))
    for wid, item in final.ended.items():
        for step, entry in item.entries.items():
            landed = (entry.engine, entry.token)
            known = accepted[wid, step] | history.unresolved[wid, step]
            hidden = entry.stale and (entry.engine, wid) in history.stale_errors
            assert landed in known or hidden, (
                f"step {step} of {wid} holds {entry}, a write no journal saw"
            )


def _write_log(path: Path, restorer: _Restorer, chaos: Chaos) -> None:
    """The restore log and the pauses, for a look after a failure."""
    copies = [
        {
            "index": c.index,
            "lo": c.lo,
            "hi": c.hi,
            "tokens": {w: t.hex() for w, t in c.tokens.items()},
        }
        for c in restorer.taken
    ]
    restores = [
        {"copy": r.copy.index, "lo": r.lo, "hi": r.hi, "paused": r.paused, "reminted": r.reminted}
        for r in restorer.done
    ]
    log = {"copies": copies, "restores": restores, "pauses": chaos.resumed}
    path.write_text(json.dumps(log), encoding="utf-8")


def _summary(
    restorer: _Restorer, chaos: Chaos, history: _History, violations: int, spans: list[float]
) -> str:
    """One line of numbers; ``spans``: seconds of start-up, chaos, completion, stop + checks."""
    c = history.counts
    refused = {
        k[len("refused_") :]: v
        for k, v in sorted(c.items())
        if k.startswith("refused_") and k != "refused_reminted"
    }
    lost = {k[len("lost_") :]: v for k, v in sorted(c.items()) if k.startswith("lost_")}
    return (
        f"restores {len(restorer.done)} (across a pause {sum(r.paused for r in restorer.done)}, "
        f"with its epoch minted again {sum(r.reminted for r in restorer.done)}, "
        f"copies {len(restorer.taken)}, attempts given up {restorer.given_up}); accepted "
        f"writes checked {len(history.writes)} (unknown token "
        f"{history.ambiguous}); observations {sum(len(s) for s in history.seen.values())}; "
        f"violations {violations}; writes refused {refused} (at a re-minted number "
        f"{c['refused_reminted']}); claims lost {lost}; store "
        f"replays refused {c['replay_store_refused']} (at a re-minted number "
        f"{c['replay_refused_reminted']}), accepted {c['replay_store_accepted']}; steps "
        f"re-driven after a restore {_redriven(history, restorer)}; conflicts {c['conflict']}; "
        f"kills {chaos.fleet.kills}, pauses {chaos.pauses}; {sum(spans):.1f} s (start-up, "
        f"chaos, completion, stop and checks: {', '.join(f'{s:.1f}' for s in spans)})"
    )


def test_restores_of_older_copies_under_chaos_let_no_write_through_a_superseded_token(
    site: _Site, tmp_path: Path
) -> None:
    started = time.monotonic()
    ids = [f"chaos-{n:03d}" for n in range(WORKFLOWS)]
    store = open_storage(site.url)
    reminter = _Reminter(site.url)
    rng = random.Random(2424)
    try:
        with open_fleet(site.url, tmp_path, ids, FLEET) as fleet:
            phases = [time.monotonic()]
            chaos = Chaos(fleet, store, rng, CHAOS)
            restorer = _Restorer(site.copies, chaos, reminter, rng, time.monotonic())
            chaos.run(
                CHAOS_MIN_S,
                CHAOS_MAX_S,
                lambda: len(restorer.done) >= RESTORES,
                restorer.tick,
            )
            phases.append(time.monotonic())
            fleet.rewalk()
            wait_all_completed(fleet, store, ids, COMPLETE_TIMEOUT_S)
            phases.append(time.monotonic())
            fleet.stop()
        final = _read_final(store, ids)
    finally:
        reminter.close()
        store.close()

    _write_log(tmp_path / "chaos-log.json", restorer, chaos)
    history = _fold(fleet, ids, restorer, final)
    violations = _violations(history, restorer, ids)
    spans = [b - a for a, b in zip([started, *phases], [*phases, time.monotonic()], strict=True)]
    print(_summary(restorer, chaos, history, len(violations), spans))
    assert not violations, f"{len(violations)} violations:\n" + "\n".join(violations[:20])
    _assert_all_completed(final)
    _assert_store_holds_only_journaled_writes(final, history)
    assert history.counts["error"] == 0
    assert len(restorer.done) >= 3, f"only {len(restorer.done)} restores"
    assert fleet.kills >= 1, "no worker was killed"
    assert history.counts["lost_store_rollback"] >= 1, "no engine noticed a restore"
    assert _redriven(history, restorer) >= 1, "no step was written again after a restore"
    assert any(r.reminted for r in restorer.done), "no restore had an epoch minted again"
    assert history.counts["refused_reminted"] >= 1, "no write came at a re-minted epoch"
