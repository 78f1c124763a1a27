"""A runnable demonstration: worker processes share one SQLite store and take over a dead peer.

Run it with ``weft-sync demo`` or ``python -m weft_sync demo``. Each worker is a separate process
with its own :class:`~weft_sync.Ownership` (background renewal, reclaim and crash detection, a
handler for the workflows' type), as a host runs it; the parent kills one worker with SIGKILL and
watches the others take its workflows over with new epochs — seen crashed through its session
lock, before its claims expire — then shows that a write fenced on the dead worker's epoch is
refused by the store.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from . import keys
from .codec import HolderRecord, decode_epoch, decode_holder, encode_epoch
from .options import OwnershipOptions
from .ownership.facade import Ownership, ReclaimedWorkflow
from .storage import Condition, Put, open_storage

Printer = Callable[[str], None]


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of the demo; the defaults finish in about five seconds."""

    workers: int = 3
    workflows: int = 9
    claim_ttl_ms: int = 1_500
    claim_renew_interval_ms: int = 500
    run_before_kill_s: float = 1.5
    takeover_deadline_s: float = 15.0


def _worker_main(
    url: str,
    name: str,
    workflow_ids: list[str],
    settings: DemoSettings,
    engine_file: str,
    stop_file: str,
) -> None:
    """Body of one worker process: claim its share, renew in the background, reclaim others.

    Workers talk to the parent through files and their own stdout only: a multiprocessing queue
    or event can be left locked by the worker the demo kills, hanging everyone else.
    """

    def say(line: str) -> None:
        # One write per line: drives run on several pool threads, and print() writes the text
        # and its newline separately, so two lines could share one.
        sys.stdout.write(f"  {name}: {line}\n")
        sys.stdout.flush()

    stopping = threading.Event()

    def pay_out(workflow_id: str) -> None:
        # Drives one payout on its own thread until the demo stops this worker, then finishes
        # it: the block is the claim's driver, and complete() releases the claim.
        with ownership.workflows.drive(workflow_id) as ctx:
            stopping.wait()
            ctx.complete({"paid": 100, "by": name})

    def resume_payout(ctx: ReclaimedWorkflow) -> None:
        # Runs on this worker's handler thread, as the workflow's new owner, and drives the
        # payout from there until the stop.
        say(f"took over {ctx.workflow_id} at epoch {ctx.epoch}")
        stopping.wait()
        ctx.workflows.complete(ctx.workflow_id, {"paid": 100, "by": name})

    options = OwnershipOptions(
        claim_ttl=settings.claim_ttl_ms, claim_renew_interval=settings.claim_renew_interval_ms
    )
    drivers: list[threading.Thread] = []
    with Ownership.open(
        url,
        options=options,
        handlers={"payout": resume_payout},
        warn=lambda w: say(f"warning: {w}"),
    ) as ownership:
        for workflow_id in workflow_ids:
            ownership.workflows.start(workflow_id, "payout", input={"amount": 100})
            epoch = ownership.registry.current_epoch(workflow_id)
            say(f"started {workflow_id}: claimed at epoch {epoch}")
            driver = threading.Thread(
                target=pay_out, args=(workflow_id,), name=f"demo-{workflow_id}", daemon=True
            )
            driver.start()
            drivers.append(driver)
        partial = Path(engine_file + ".tmp")
        partial.write_text(ownership.engine_id)
        partial.rename(engine_file)  # the file appearing whole is the "ready" signal
        while not Path(stop_file).exists():
            time.sleep(0.05)
        stopping.set()
        for driver in drivers:
            driver.join(5.0)
    say("stopped: finished its payouts, which released their claims")


def _holders(url: str, workflow_ids: list[str]) -> dict[str, HolderRecord]:
    with open_storage(url, read_only=True) as storage:
        found: dict[str, HolderRecord] = {}
        for workflow_id in workflow_ids:
            holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
            if holder is not None:
                found[workflow_id] = holder
        return found


def run_demo(
    out: Printer = print, settings: DemoSettings | None = None, *, keep_dir: str | None = None
) -> int:
    """Run the demonstration, narrating through ``out``; return a process exit code.

    :param keep_dir: keep the store (``demo.db``) in this directory, created if missing,
        instead of a temporary one that is deleted at the end.
    :raises ValueError: ``keep_dir`` already holds a ``demo.db``.
    """
    settings = settings or DemoSettings()
    store_dir = None if keep_dir is None else _prepare_keep_dir(keep_dir)
    with tempfile.TemporaryDirectory(prefix="weft-demo-") as tmp:
        url = f"sqlite:///{Path(store_dir or tmp) / 'demo.db'}"
        ids = [f"payout-{n:02d}" for n in range(settings.workflows)]
        out(f"1. Store: {url}")
        out(
            f"2. Starting {settings.workers} worker processes; each starts (and so claims) its "
            f"share of {len(ids)} payout workflows"
        )
        stop_file = Path(tmp) / "stop"
        workers: list[_Worker] = []
        try:
            # Started here, not inside _sigint_deferred below: starting it unblocks SIGINT,
            # which would let a Ctrl-C land while SIGINT is still ignored.
            resource_tracker.ensure_running()
            for index in range(settings.workers):
                worker = _new_worker(index, url, ids, settings, Path(tmp), stop_file)
                workers.append(worker)  # before it starts, so the finally below stops it
                # Ctrl-C in a terminal reaches the whole process group; a worker starts with
                # SIGINT ignored (a spawned interpreter keeps that), so only this process acts
                # on it, stopping the workers through the stop file.
                with _sigint_deferred():
                    worker.process.start()
            if not all(worker.wait_ready(30) for worker in workers):
                out("   a worker did not start in time")
                return 1
            code = _kill_and_watch(out, settings, url, ids, workers)
        finally:
            with _sigint_ignored():
                stop_file.touch()
                for worker in workers:
                    worker.join()
        if store_dir is not None:
            out(f"6. The store is kept: weft-sync --url {url} status")
        return code


def _prepare_keep_dir(keep_dir: str) -> str:
    path = Path(keep_dir)
    if (path / "demo.db").exists():
        raise ValueError(
            f"--keep directory {keep_dir!r} already holds a demo.db; choose an empty or new "
            f"directory"
        )
    path.mkdir(parents=True, exist_ok=True)
    return str(path.resolve())


def _new_worker(
    index: int, url: str, ids: list[str], settings: DemoSettings, tmp: Path, stop_file: Path
) -> _Worker:
    name = f"worker-{index + 1}"
    worker = _Worker(name, tmp / f"{name}.engine")
    worker.process = multiprocessing.get_context("spawn").Process(
        target=_worker_main,
        args=(
            url,
            name,
            ids[index :: settings.workers],
            settings,
            str(worker.engine_file),
            str(stop_file),
        ),
        name=name,
    )
    return worker


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ignore SIGINT for what starts inside the block; one arriving meanwhile waits, then lands.

    SIGINT is blocked as well as ignored: Linux keeps a blocked signal pending even while its
    action is "ignore", so a Ctrl-C during the block is delivered once the handler is back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT inside the block (when called on the main thread, where signals land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class _Worker:
    name: str
    engine_file: Path
    process: Any = None

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.engine_file.exists():
            if time.monotonic() > deadline or not self.process.is_alive():
                return False
            time.sleep(0.05)
        return True

    @property
    def engine_id(self) -> str:
        return self.engine_file.read_text()

    def join(self) -> None:
        if self.process is None or self.process.pid is None:
            return  # never started
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _kill_and_watch(
    out: Printer, settings: DemoSettings, url: str, ids: list[str], workers: list[_Worker]
) -> int:
    time.sleep(settings.run_before_kill_s)
    names = {worker.engine_id: worker.name for worker in workers}
    victim = workers[0]
    before = _holders(url, ids)
    victim_ids = sorted(w for w, h in before.items() if h.engine_id == victim.engine_id)
    ttl_bound_ms = settings.claim_ttl_ms + 2 * settings.claim_renew_interval_ms
    out(
        f"3. Renewals keep every claim alive. Killing {victim.name} (SIGKILL) while it holds "
        f"{', '.join(victim_ids)}"
    )
    out(
        "   the survivors watch every engine's session lock: they should see it crashed and "
        "take its claims over within about 0.1-0.4 s, long before the claims expire (without "
        f"crash detection: up to TTL + 2 x renew interval = {ttl_bound_ms} ms after its last "
        "renewal)"
    )
    os.kill(victim.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    after = before
    while time.monotonic() < killed_at + settings.takeover_deadline_s:
        after = _holders(url, ids)
        if all(w in after and after[w].engine_id != victim.engine_id for w in victim_ids):
            break
        time.sleep(0.02)
    elapsed_ms = int((time.monotonic() - killed_at) * 1000)
    taken = [w for w in victim_ids if w in after and after[w].engine_id != victim.engine_id]
    out(f"4. {len(taken)} of {len(victim_ids)} taken over {elapsed_ms} ms after the kill:")
    early = 0
    for workflow_id in victim_ids:
        old = before[workflow_id]
        new = after.get(workflow_id)
        if new is None or new.engine_id == victim.engine_id:
            out(f"   {workflow_id}: epoch {old.epoch}, still held by the dead {victim.name}")
            continue
        # Taken before the dead holder's claim expired: only crash detection does that.
        how = "before its claim expired" if new.claimed_at < old.expires_at else "after expiry"
        early += new.claimed_at < old.expires_at
        out(
            f"   {workflow_id}: epoch {old.epoch} -> {new.epoch}, held by "
            f"{names.get(new.engine_id, new.engine_id)}, {how}"
        )
    if victim_ids and early == len(victim_ids):
        out("   every claim moved before it expired: the crash was detected, not waited out")
    ok = len(taken) == len(victim_ids) and _show_fence(out, url, victim_ids, before)
    out("5. Stopping the surviving workers (they finish their payouts, releasing the claims).")
    return 0 if ok else 1


def _show_fence(
    out: Printer, url: str, victim_ids: list[str], before: dict[str, HolderRecord]
) -> bool:
    if not victim_ids:
        return True
    workflow_id = victim_ids[0]
    stale_epoch = before[workflow_id].epoch
    with open_storage(url) as storage:
        current = decode_epoch(storage.get(keys.workflow_owner_epoch(workflow_id)))
        fence = Condition(keys.workflow_owner_epoch(workflow_id), encode_epoch(stale_epoch))
        accepted = storage.conditional_batch(
            [fence], [Put(keys.workflow(workflow_id) + ":ckpt", b"stale step")]
        )
    verdict = "ACCEPTED (this must never happen)" if accepted else "refused by the store"
    out(
        f"   a late write from {workflow_id}'s dead owner, fenced on its epoch {stale_epoch} "
        f"(the store now says {current}): {verdict}"
    )
    return not accepted
