"""Fork loop on SQLite: children forked while the parent writes, each writing on its own at once.

The parent holds 5 running workflows (TTL 3 s, renew interval 100 ms), driven by its one thread (a
``drive()`` block each), with manual maintenance, and forks N children (200; ``--quick``: 50) one
after another from that thread. While each child runs, that thread saves the parent's checkpoints
without pause, runs the parent's maintenance (renewal) every renew interval and samples one parent
holder, recording the longest stretch without a renewal. So the parent writes while every child
runs, and no thread of the library is inside SQLite at the instant of a fork: the supported way to
fork (a fork never waits for the library; see ``weft_sync.storage.sqlite.fork``). Each child opens
its own ``Ownership`` on the same file (manual maintenance), starts and completes one workflow, and
reports its timings through a pipe.

Printed: the parent's ``os.fork()`` call, the child's first write (from its first instruction to
its ``start()`` committed, including opening the store and the ``Ownership``), the floor (the
same open and start in a process started without fork, a spawned worker, interleaved after every
child against the same parent), their ratio, and the parent's longest renewal gap against the
renew interval. The target: every child writes, its first write within 1 s.

``--threaded`` forks from a parent whose library threads are busy instead: interval maintenance
and a thread saving checkpoints without pause, as a host that forks with the library running
would. A child forked while one of those threads was inside SQLite leaves the connections it
inherited untouched and may find the file locked: the printed failures measure that.

``--bare`` runs the storage-level loop: the parent has one ``SqliteStorage`` that its forking
thread writes (a write every millisecond) while each child opens its own ``SqliteStorage`` on
the file and writes one key (``--threaded``: written by 3 threads without pause instead). It
prints the children that failed, their first-write latency and the parent's writes during the
loop (and how many failed).

    python bench/fork_loop.py [--quick] [--forks N] [--bare] [--threaded]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_note
from weft_sync import Ownership, OwnershipOptions, SqliteStorage, StorageError, keys
from weft_sync.codec import decode_holder

OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=100)
PARENT_WORKFLOWS = 5
_REPORT = struct.Struct("dd")


def _child(url: str, index: int, out: int) -> None:
    began = time.monotonic()
    with Ownership.open(url, options=OPTIONS, background="manual") as own:
        own.workflows.start(f"child-{index}", "job")
        first = time.monotonic() - began
        own.workflows.complete(f"child-{index}", index)
    os.write(out, _REPORT.pack(first, time.monotonic() - began))


def floor(url: str, index: int) -> float:
    """The child's work in a process that was not forked (runs in a spawned worker)."""
    began = time.monotonic()
    with Ownership.open(url, options=OPTIONS, background="manual") as own:
        own.workflows.start(f"floor-{index}", "job")
        elapsed = time.monotonic() - began
        own.workflows.complete(f"floor-{index}", index)
    return elapsed


class _Sampler:
    """Record the longest time one holder record went without being renewed."""

    def __init__(self, ownership: Ownership, workflow_id: str) -> None:
        self._ownership = ownership
        self._key = keys.workflow_owner_holder(workflow_id)
        self._stop = threading.Event()
        self.longest_s = 0.0
        self._thread = threading.Thread(target=self._run, name="renewal-sampler")
        self._thread.start()

    def _run(self) -> None:
        last_value, last_change = None, time.monotonic()
        while not self._stop.wait(0.005):
            holder = decode_holder(self._ownership.storage.get(self._key))
            value = None if holder is None else holder.expires_at
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
            self.longest_s = max(self.longest_s, now - last_change)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Gaps:
    """The longest time one holder record went without being renewed, sampled by the caller."""

    def __init__(self, ownership: Ownership, workflow_id: str) -> None:
        self._ownership = ownership
        self._key = keys.workflow_owner_holder(workflow_id)
        self._last: int | None = None
        self._last_change = time.monotonic()
        self.longest_s = 0.0

    def sample(self) -> None:
        holder = decode_holder(self._ownership.storage.get(self._key))
        value = None if holder is None else holder.expires_at
        now = time.monotonic()
        if value != self._last:
            self._last, self._last_change = value, now
        self.longest_s = max(self.longest_s, now - self._last_change)


def _run(forks: int, root: Path, threaded: bool) -> None:
    url = f"sqlite:///{root / 'loop.db'}"
    background: Literal["thread", "manual"] = "thread" if threaded else "manual"
    parent = Ownership.open(url, options=OPTIONS, engine_id="parent", background=background)
    drives = contextlib.ExitStack()  # closed after the parent: its drives end with no claim left
    stop = threading.Event()
    ids = [f"parent-{i}" for i in range(PARENT_WORKFLOWS)]
    for wid in ids:
        parent.workflows.start(wid, "job")
        drives.enter_context(parent.workflows.drive(wid))  # the forking thread drives them
    written = [0]

    def save_checkpoints() -> None:
        for wid in ids:
            parent.workflows.save_checkpoint(wid, str(written[0]).encode())
            written[0] += 1

    def checkpoints() -> None:
        while not stop.is_set():
            save_checkpoints()

    writer = threading.Thread(target=checkpoints, name="parent-checkpoints")
    sampler: _Sampler | _Gaps
    if threaded:
        writer.start()
        sampler = _Sampler(parent, ids[0])
    else:
        sampler = _Gaps(parent, ids[0])
    renewed_at = time.monotonic()

    def parent_works_until(finished: Callable[[], bool]) -> None:
        # The parent's own work while a child (or the floor) runs: write, renew when due, sample.
        nonlocal renewed_at
        while not finished():
            if threaded:
                time.sleep(0.001)
                continue
            save_checkpoints()
            if time.monotonic() - renewed_at >= OPTIONS.claim_renew_interval_ms / 1000:
                parent.run_maintenance()
                renewed_at = time.monotonic()
            assert isinstance(sampler, _Gaps)
            sampler.sample()

    def while_child_runs(pid: int) -> int:
        waited: list[int] = []

        def exited() -> bool:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                waited.append(status)
            return bool(done)

        parent_works_until(exited)
        return waited[0]

    spawned = multiprocessing.get_context("spawn").Pool(1)
    fork_calls, firsts, totals, floors, failed = [], [], [], [], 0
    try:
        for index in range(forks):
            read_end, write_end = os.pipe()
            began = time.monotonic()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(read_end)
                    _child(url, index, write_end)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            fork_calls.append(time.monotonic() - began)
            os.close(write_end)
            status = while_child_runs(pid)
            data = os.read(read_end, _REPORT.size)
            os.close(read_end)
            if os.waitstatus_to_exitcode(status) != 0 or len(data) != _REPORT.size:
                failed += 1
                continue
            first, total = _REPORT.unpack(data)
            firsts.append(first)
            totals.append(total)
            measured = spawned.apply_async(floor, (url, index))
            parent_works_until(measured.ready)  # against the same writing parent as a child
            floors.append(measured.get())
    finally:
        stop.set()
        if threaded:
            writer.join()
            assert isinstance(sampler, _Sampler)
            sampler.stop()
        spawned.close()
        spawned.join()
        failures = parent.metrics.snapshot().renewal_failures
        held = len(parent.registry.list_held_workflow_ids())
        parent.close()
        drives.close()

    def ms(value: float) -> str:
        return f"{value * 1000:,.1f} ms"

    print(machine_note())
    mode = "threaded parent (library threads busy at fork)" if threaded else "parent forks idle"
    print(
        f"{mode}: {forks} forks, {forks - failed}/{forks} children wrote, {failed} failed; "
        f"parent: {written[0]:,} checkpoints saved, {failures} renewal failures, "
        f"{held} of {PARENT_WORKFLOWS} claims still held"
    )
    print("| measure | median | max |")
    print("| --- | --- | --- |")
    fork_median, fork_max = ms(statistics.median(fork_calls)), ms(max(fork_calls))
    print(f"| parent os.fork() call | {fork_median} | {fork_max} |")
    if firsts:
        print(
            f"| child first write (open + start) | {ms(statistics.median(firsts))} | "
            f"{ms(max(firsts))} |"
        )
        print(
            f"| child total (open, start, complete, close) | {ms(statistics.median(totals))} | "
            f"{ms(max(totals))} |"
        )
        print(
            f"| floor: same open + start, spawned process | {ms(statistics.median(floors))} | "
            f"{ms(max(floors))} |"
        )
        ratio = statistics.median(firsts) / statistics.median(floors)
        print(
            f"child first write / floor (medians): {ratio:.2f}x; "
            f"worst child first write {ms(max(firsts))} (target: under 1,000 ms)"
        )
    print(
        f"parent's longest renewal gap: {ms(sampler.longest_s)} "
        f"({sampler.longest_s * 1000 / OPTIONS.claim_renew_interval_ms:.1f}x the renew interval)"
    )


def _run_bare(forks: int, root: Path, threaded: bool) -> None:
    path = root / "bare.db"
    store = SqliteStorage(path, busy_timeout_ms=1000)
    stop = threading.Event()
    writes, errors = [0], [0]

    def write() -> None:
        while not stop.is_set():
            try:
                store.put(f"parent-{writes[0] % 50}", b"x" * 100)
                writes[0] += 1
                store.get("parent-1")
            except StorageError:
                errors[0] += 1  # e.g. the writer lock held too long by another process

    threads = [threading.Thread(target=write, name=f"parent-writer-{i}") for i in range(3)]
    if threaded:
        for thread in threads:
            thread.start()
    firsts: list[float] = []
    failed = 0
    began = time.monotonic()
    for index in range(forks):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read_end)
                start = time.monotonic()
                with SqliteStorage(path, busy_timeout_ms=1000) as own:
                    own.put(f"child-{index}", b"1")
                    os.write(write_end, _REPORT.pack(time.monotonic() - start, 0.0))
                code = 0
            except BaseException as exc:
                print(f"child {index} failed: {exc!r}", file=sys.stderr)
            finally:
                os._exit(code)
        os.close(write_end)
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if threaded:
                time.sleep(0.001)
                continue
            try:  # the forking thread writes while the child runs
                store.put(f"parent-{writes[0] % 50}", b"x" * 100)
                writes[0] += 1
            except StorageError:
                errors[0] += 1
            # A breath between writes: back to back, one process re-taking the writer lock
            # at once can keep a child (1 s busy timeout) from it on a loaded machine.
            time.sleep(0.001)
        status = done[1]
        data = os.read(read_end, _REPORT.size)
        os.close(read_end)
        if os.waitstatus_to_exitcode(status) != 0 or len(data) != _REPORT.size:
            failed += 1
        else:
            firsts.append(_REPORT.unpack(data)[0])
    elapsed = time.monotonic() - began
    stop.set()
    if threaded:
        for thread in threads:
            thread.join()
    store.close()
    print(machine_note())
    print(
        f"bare loop: {forks} forks in {elapsed:.1f} s, {failed} children failed to write; "
        f"the parent made {writes[0]:,} writes meanwhile ({errors[0]} failed)"
    )
    if firsts:
        print(
            f"child first write: median {statistics.median(firsts) * 1000:,.1f} ms, "
            f"max {max(firsts) * 1000:,.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 forks")
    parser.add_argument("--forks", type=int, default=None)
    parser.add_argument("--bare", action="store_true", help="the storage-level loop")
    parser.add_argument(
        "--threaded", action="store_true", help="fork while the library's threads are busy"
    )
    args = parser.parse_args()
    forks = args.forks or (50 if args.quick else 200)
    with tempfile.TemporaryDirectory(prefix="weft-fork-loop-") as root:
        (_run_bare if args.bare else _run)(forks, Path(root), args.threaded)


if __name__ == "__main__":
    main()
