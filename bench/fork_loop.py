"""Fork loop on SQLite: children forked while the parent writes, each writing on its own at once.

The parent holds 5 running workflows with interval renewal (TTL 3 s, renew interval 100 ms) and
a thread saving their checkpoints without pause. It forks N children (200; ``--quick``: 50) one
after another; each opens its own ``Ownership`` on the same file (manual maintenance), starts and
completes one workflow, and reports its timings through a pipe. A sampler thread in the parent
reads one parent holder every 5 ms and records the longest stretch without a renewal.

Printed: the parent's ``os.fork()`` call (it waits for the reads and writes in flight), the
child's first write (from its first instruction to its ``start()`` committed, including opening
the store and the ``Ownership``), the floor (the same open and start in a process started
without fork, a spawned worker, interleaved after every child against the same busy parent),
their ratio, and the parent's longest renewal gap against the renew interval. The issue's target:
every child's first write within 1 s. The parent's checkpoint thread writes without pause, so
the children also measure how a writer in another process fares against a busy one.

``--bare`` runs the storage-level loop instead: the parent has one ``SqliteStorage`` written by
3 threads without pause; each child opens its own ``SqliteStorage`` on the file and writes one
key. It prints the children that failed, their first-write latency and the parent's writes
during the loop (and how many failed). It uses nothing but the storage API, so a copy of this
file placed in an older checkout's ``bench/`` measures that code for a before/after.

    python bench/fork_loop.py [--quick] [--forks N] [--bare]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import struct
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_note
from weft_sync import keys
from weft_sync.codec import decode_holder
from weft_sync.errors import StorageError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership import Ownership
from weft_sync.storage import SqliteStorage

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


def _run(forks: int, root: Path) -> None:
    url = f"sqlite:///{root / 'loop.db'}"
    parent = Ownership.open(url, options=OPTIONS, engine_id="parent")
    stop = threading.Event()
    ids = [f"parent-{i}" for i in range(PARENT_WORKFLOWS)]
    for wid in ids:
        parent.workflows.start(wid, "job")

    def checkpoints() -> None:
        n = 0
        while not stop.is_set():
            for wid in ids:
                parent.workflows.save_checkpoint(wid, str(n).encode())
                n += 1

    writer = threading.Thread(target=checkpoints, name="parent-checkpoints")
    writer.start()
    sampler = _Sampler(parent, ids[0])
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
            data = os.read(read_end, _REPORT.size)
            os.close(read_end)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0 or len(data) != _REPORT.size:
                failed += 1
                continue
            first, total = _REPORT.unpack(data)
            firsts.append(first)
            totals.append(total)
            floors.append(spawned.apply(floor, (url, index)))
    finally:
        stop.set()
        writer.join()
        sampler.stop()
        spawned.close()
        spawned.join()
        failures = parent.metrics.snapshot().renewal_failures
        held = len(parent.registry.list_held_workflow_ids())
        parent.close()

    def ms(value: float) -> str:
        return f"{value * 1000:,.1f} ms"

    print(machine_note())
    print(
        f"{forks} forks, {failed} children failed; parent: {failures} renewal failures, "
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


def _run_bare(forks: int, root: Path) -> None:
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
            except BaseException:
                pass
            finally:
                os._exit(code)
        os.close(write_end)
        data = os.read(read_end, _REPORT.size)
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or len(data) != _REPORT.size:
            failed += 1
        else:
            firsts.append(_REPORT.unpack(data)[0])
    elapsed = time.monotonic() - began
    stop.set()
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
    args = parser.parse_args()
    forks = args.forks or (50 if args.quick else 200)
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads on 3.12+
    with tempfile.TemporaryDirectory(prefix="weft-fork-loop-") as root:
        (_run_bare if args.bare else _run)(forks, Path(root))


if __name__ == "__main__":
    main()
