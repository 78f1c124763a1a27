"""Who holds the SQLite writer lock, for how long, and what a hand-off costs, with 4 processes.

Each of ``--processes`` spawned processes (4 by default) runs one cycle at a time for
``--seconds``, like the 4-process layout of ``bench/acquire_release.py``: ``with
own.claim(id): pass`` (``claim``), the same without the crash probe (``claim-noprobe``),
``registry.acquire`` + ``release`` (``registry``) or that benchmark's raw floor (``raw``).

In the library's processes the cross-process writer ``flock`` (``WriterFileLock``) and the steps
of each write transaction are timed by wrapping this process's classes (an experiment on private
attributes, never a configuration). ``--wait`` swaps how a library process waits for the flock:
``poll`` is the library's own; ``block`` is a blocking ``flock`` (unbounded, so not something the
library may do: it shows what an instant kernel hand-off gives); ``sleep:US[:CAP_US]`` polls from
US doubling up to CAP_US microseconds. A ``+in:US`` or ``+out:US`` suffix adds US microseconds of
busy CPU to every commit, inside the lock window or just before the wait for it: whether work
moved out of the window pays depends on whether another process fills the window meanwhile. The
raw floor has no flock: its ``BEGIN IMMEDIATE`` … ``COMMIT`` windows are timed instead.

Printed per run: cycles per second and process CPU per cycle (every thread); per commit the
wait for the lock and the time holding it, split into ``BEGIN IMMEDIATE``, the requests, the
pre-commit identity check and the rest (mostly ``COMMIT``); and, from every process's windows
merged on the shared monotonic clock, how busy the lock was, how often the next window is the
same process's (the holder took the lock again before a waiter did), the hold of a window that
follows one of the same process and of one that follows another process (the new holder's SQLite
page cache was dropped, since another connection wrote), and the idle gap before each.

With ``--rounds N`` (N > 1) every variant runs once per round, in turn, and only medians are
printed: cycles per second, the share of windows taken next by the same process, and the fewest
cycles of one process over the most.

    python bench/lock_window.py [--variant claim,registry,raw] [--processes 4] [--seconds 3]
        [--wait poll,block,sleep:US[:CAP_US][+in:US|+out:US]] [--rounds N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acquire_release import ClaimContext, RawSqliteContext, Target, open_context
from bench.common import RENEW_MS, TTL_MS, StoreSpec, machine_note
from weft_sync import Ownership, OwnershipOptions
from weft_sync.storage import open_storage
from weft_sync.storage.sqlite.identity import DIR_STAMP_MARGIN_NS

# "rest": the hold less the timed steps, mostly COMMIT (its write and sync).
STEPS = ("wait", "hold", "begin", "requests", "identity", "rest")
Window = tuple[int, float, float]  # pid, start, end (time.monotonic)
Stats = dict[str, list[float]]


def _waiting(how: str) -> Callable[[Any], None]:
    """A ``WriterFileLock.__enter__`` that waits ``how`` (``block`` or ``sleep:US[:CAP_US]``)."""
    parts = how.split(":")
    low = float(parts[1]) / 1e6 if len(parts) > 1 else 0.0
    cap = float(parts[2]) / 1e6 if len(parts) > 2 else low

    def enter(self: Any) -> None:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        if parts[0] == "block":
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._held = self._fd
            return
        delay = low
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._held = self._fd
                return
            except BlockingIOError:
                time.sleep(delay)
                delay = min(delay * 2, cap)

    return enter


def _spin(us: float) -> None:
    """Keep the CPU busy for ``us`` microseconds."""
    until = time.perf_counter() + us / 1e6
    while time.perf_counter() < until:
        pass


def _instrument(stats: Stats, windows: list[Window], how: str) -> None:
    """Time the flock wait and hold and the transaction's steps in this process."""
    import weft_sync.storage.sqlite.identity as identity_module
    import weft_sync.storage.sqlite.writer as writer_module

    lock_cls: Any = writer_module.WriterFileLock
    writer_cls: Any = writer_module.SqliteWriter
    identity_cls: Any = identity_module.StoreIdentity
    # "+in:US" / "+out:US" after the wait: US microseconds of busy CPU per commit, inside the
    # lock window or just before waiting for the lock.
    how, _, extra = how.partition("+")
    inside_us = float(extra[3:]) if extra.startswith("in:") else 0.0
    outside_us = float(extra[4:]) if extra.startswith("out:") else 0.0
    if how != "poll":
        lock_cls.__enter__ = _waiting(how)
    enter, exit_ = lock_cls.__enter__, lock_cls.__exit__
    pid = os.getpid()
    held_since = [0.0]
    inside = [0.0]  # the timed steps' time in the current window

    def timed_enter(self: Any) -> None:
        if outside_us:
            _spin(outside_us)
        began = time.monotonic()
        enter(self)
        held_since[0] = time.monotonic()
        inside[0] = 0.0
        stats["wait"].append(held_since[0] - began)
        if inside_us:
            _spin(inside_us)

    def timed_exit(self: Any, *exc: Any) -> None:
        end = time.monotonic()  # before the unlock: a woken waiter may run before it returns
        exit_(self, *exc)
        stats["hold"].append(end - held_since[0])
        stats["rest"].append(end - held_since[0] - inside[0])
        windows.append((pid, held_since[0], end))

    def timing(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return func(*args, **kwargs)
            finally:
                took = time.monotonic() - began
                stats[name].append(took)
                inside[0] += took

        return timed

    lock_cls.__enter__ = timed_enter
    lock_cls.__exit__ = timed_exit
    writer_cls._begin_immediate = timing("begin", writer_cls._begin_immediate)
    writer_cls._apply_request = timing("requests", writer_cls._apply_request)
    identity_cls.check_before_commit = timing("identity", identity_cls.check_before_commit)


class _TimedConnection:
    """A raw floor connection whose ``BEGIN IMMEDIATE`` … ``COMMIT`` windows are recorded."""

    def __init__(self, conn: Any, windows: list[Window], stats: Stats) -> None:
        self._conn = conn
        self._windows = windows
        self._stats = stats
        self._began = 0.0

    def execute(self, sql: str, *args: Any) -> Any:
        asked = time.monotonic()
        result = self._conn.execute(sql, *args)
        now = time.monotonic()
        if sql == "BEGIN IMMEDIATE":
            self._began = now
            self._stats["wait"].append(now - asked)
        elif sql in ("COMMIT", "ROLLBACK"):
            self._stats["rest"].append(now - asked)
            self._stats["hold"].append(now - self._began)
            self._windows.append((os.getpid(), self._began, now))
        return result

    def close(self) -> None:
        self._conn.close()


@dataclass(frozen=True)
class _TimedSpec:
    """What ``RawSqliteContext`` asks of a store spec, handing out timed connections."""

    spec: StoreSpec
    windows: list[Window]
    stats: Stats

    @property
    def table(self) -> str:
        return self.spec.table

    def raw_sqlite(self) -> _TimedConnection:
        return _TimedConnection(self.spec.raw_sqlite(), self.windows, self.stats)


def _open(variant: str, target: Target, stats: Stats, windows: list[Window]) -> Any:
    if variant == "raw":
        return RawSqliteContext(_TimedSpec(target.spec, windows, stats), shared=False)  # type: ignore[arg-type]
    if variant == "claim-noprobe":
        context = ClaimContext.__new__(ClaimContext)
        options = OwnershipOptions(
            claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, crash_poll_interval=None
        )
        context.ownership = Ownership.open(target.spec.url, options=options)
        return context
    return open_context({"claim": "claim()", "registry": "registry"}[variant], target)


def _child(
    variant: str, target: Target, worker: int, seconds: float, how: str, go: Any, out: Any
) -> None:
    stats: Stats = {step: [] for step in STEPS}
    windows: list[Window] = []
    if variant != "raw":
        _instrument(stats, windows, how)
    context = _open(variant, target, stats, windows)
    try:
        cycle = context.cycle_for(worker)
        for _ in range(50):
            cycle()
        for values in stats.values():
            values.clear()
        windows.clear()
        out.put(None)
        go.wait()
        began, cpu, done = time.monotonic(), time.process_time(), 0
        while time.monotonic() - began < seconds:
            cycle()
            done += 1
        elapsed = time.monotonic() - began
        stats["cpu"] = [time.process_time() - cpu]
    finally:
        context.close()
    out.put((done, elapsed, stats, windows))


@dataclass(frozen=True)
class Outcome:
    """One run: cycles per second, the share of windows the same process took next, and the
    fewest cycles of one process over the most (1.0: every process did as many)."""

    rate: float
    same: float
    spread: float


def _us(values: list[float]) -> str:
    us = sorted(v * 1e6 for v in values)
    return (
        f"median {statistics.median(us):7.1f} us, mean {statistics.fmean(us):7.1f}, "
        f"p90 {us[int(len(us) * 0.9)]:7.1f} (n={len(us)})"
    )


def _report(variant: str, rate: float, results: list[Any], windows: list[Window]) -> None:
    total = sum(r[0] for r in results)
    slowest = max(r[1] for r in results)
    cpu = sum(r[2]["cpu"][0] for r in results)
    print(f"\n{variant}: {rate:,.0f} cycles/s, {len(windows) / slowest:,.0f} commits/s")
    print(f"  cycles per process {[r[0] for r in results]}; CPU {cpu / total * 1e6:.0f} us/cycle")
    for step in STEPS:
        values = [v for r in results for v in r[2][step]]
        if values:
            print(f"  {step:9s} {_us(values)}")
    pairs = list(itertools.pairwise(windows))
    span = windows[-1][2] - windows[0][1]
    held = sum(end - start for _, start, end in windows)
    same = [(a, b) for a, b in pairs if a[0] == b[0]]
    other = [(a, b) for a, b in pairs if a[0] != b[0]]
    print(
        f"  lock held {held / span:.0%} of the time; next window by the same process: "
        f"{len(same) / len(pairs):.0%}"
    )
    for label, group in (("the same process", same), ("another process", other)):
        if group:
            print(f"  after a window of {label}:")
            print(f"    gap  {_us([b[1] - a[2] for a, b in group])}")
            print(f"    hold {_us([b[2] - b[1] for _, b in group])}")


def run(
    variant: str, target: Target, processes: int, seconds: float, how: str, quiet: bool
) -> Outcome:
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(variant, target, 200 + n, seconds, how, go, out))
        for n in range(processes)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        out.get(timeout=120)
    go.set()
    results = [out.get(timeout=120 + seconds) for _ in procs]
    for proc in procs:
        proc.join(30)
    windows = sorted((w for r in results for w in r[3]), key=lambda w: w[1])
    done = [r[0] for r in results]
    rate = sum(done) / max(r[1] for r in results)
    pairs = list(itertools.pairwise(windows))
    same = sum(1 for a, b in pairs if a[0] == b[0]) / max(1, len(pairs))
    if not quiet and pairs:
        _report(variant if variant == "raw" else f"{variant} ({how})", rate, results, windows)
    return Outcome(rate, same, min(done) / max(1, max(done)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="claim,registry,raw")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    parser.add_argument(
        "--wait",
        default="poll",
        help="how the library's processes wait for the flock: poll, block, sleep:US[:CAP_US], "
        "optionally followed by +in:US or +out:US (busy CPU per commit inside the lock window "
        "or just before the wait); several, comma-separated, run in turn",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weft-lock-window-", dir=args.dir) as directory:
        measure(args, directory)


def measure(args: argparse.Namespace, directory: str) -> None:
    """Run every round of every variant on a store in ``directory``; print the medians."""
    path = os.path.join(directory, "store.db")
    spec = StoreSpec("sqlite", f"sqlite:///{path}?table=kv", "kv", path=path)
    resident = open_storage(spec.url)
    # An engine creates the session-lock directory next to the store once; let the store's
    # directory settle after that, so that the identity check rests on its stamp.
    Ownership.open(spec.url).close()
    time.sleep(DIR_STAMP_MARGIN_NS / 1e9 + 0.2)
    print(f"lock windows, {args.processes} processes; {machine_note()}; store in {directory}")
    target = Target(spec, directory, None)
    outcomes: dict[str, list[Outcome]] = {}
    try:
        for _ in range(args.rounds):
            for variant in args.variant.split(","):
                for how in ["poll"] if variant == "raw" else args.wait.split(","):
                    name = variant if variant == "raw" else f"{variant} ({how})"
                    outcome = run(
                        variant, target, args.processes, args.seconds, how, args.rounds > 1
                    )
                    outcomes.setdefault(name, []).append(outcome)
    finally:
        resident.close()
    if args.rounds > 1:
        print(f"\nmedians of {args.rounds} rounds (each round runs every variant in turn)")
        print(f"  {'variant':26s} {'cycles/s':>9s} {'same next':>10s} {'min/max':>8s}  each round")
        for name, runs in outcomes.items():
            rate = statistics.median(o.rate for o in runs)
            same = statistics.median(o.same for o in runs)
            spread = statistics.median(o.spread for o in runs)
            rounds = [round(o.rate) for o in runs]
            print(f"  {name:26s} {rate:9,.0f} {same:10.0%} {spread:8.2f}  {rounds}")


if __name__ == "__main__":
    main()
