"""Fork loop against a foreign SQLite user: how many children hang inside SQLite.

A parent thread that is not weft_sync's opens a plain ``sqlite3`` connection on a file of its
own, binds a blob (an allocation inside SQLite), and closes it, without pause: it is inside
SQLite's process-wide mutexes (the unix VFS's, the allocator's) most of the time. Meanwhile the
main thread forks N children (200; ``--quick``: 50) one after another, each inheriting an open
``SqliteStorage`` that the fork handlers close in the child; the child then opens its own
storage on the same file, writes and reads one key, and exits. A child that has not exited
within ``--child-timeout`` seconds (2) is counted as hung and killed.

Printed: the children that hung, that failed, the parent's ``os.fork()`` call (median and max)
and how many foreign open/close cycles the parent thread made meanwhile. With ``--no-guard``
the fork handlers leave SQLite's mutexes alone (the behaviour before they took them), for a
before/after in one run.

    python bench/fork_foreign_sqlite.py [--quick] [--forks N] [--child-timeout S] [--no-guard]
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_note
from weft_sync.storage import (
    SqliteStorage,
    sqlite_mutexes,
)


def _foreign_churn(path: Path, stop: threading.Event, cycles: list[int]) -> None:
    blob = b"x" * 4096
    while not stop.is_set():
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("SELECT length(?)", (blob,)).fetchone()
        conn.close()
        cycles[0] += 1


def _child(path: Path) -> None:
    with SqliteStorage(path, busy_timeout_ms=2000) as own:
        own.put("child", b"1")
        assert own.get("child") == b"1"


def _wait(pid: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 forks")
    parser.add_argument("--forks", type=int, default=None)
    parser.add_argument("--child-timeout", type=float, default=2.0)
    parser.add_argument("--no-guard", action="store_true", help="leave SQLite's mutexes alone")
    args = parser.parse_args()
    forks = args.forks or (50 if args.quick else 200)
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads on 3.12+
    if args.no_guard:
        # As where the library cannot be reached: forks leave SQLite's mutexes alone.
        sqlite_mutexes._loaded = "left alone (--no-guard)"
    with tempfile.TemporaryDirectory(prefix="weft-fork-foreign-") as root:
        path = Path(root) / "store.db"
        store = SqliteStorage(path, busy_timeout_ms=2000)
        store.put("parent", b"1")
        assert store.get("parent") == b"1"  # a read connection to close in each child
        stop, cycles = threading.Event(), [0]
        churn = threading.Thread(
            target=_foreign_churn, args=(Path(root) / "foreign.db", stop, cycles), name="foreign"
        )
        churn.start()
        outcomes: dict[str, int] = {"ok": 0, "failed": 0, "hung": 0}
        fork_calls: list[float] = []
        began = time.monotonic()
        try:
            for _ in range(forks):
                start = time.monotonic()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        _child(path)
                        code = 0
                    finally:
                        os._exit(code)
                fork_calls.append(time.monotonic() - start)
                outcomes[_wait(pid, args.child_timeout)] += 1
        finally:
            stop.set()
            churn.join()
            store.close()
        elapsed = time.monotonic() - began
    print(machine_note())
    print(f"SQLite mutexes at fork: {sqlite_mutexes.describe()}")
    print(
        f"{forks} forks in {elapsed:.1f} s: {outcomes['hung']} children hung "
        f"(killed after {args.child_timeout:g} s), {outcomes['failed']} failed, "
        f"{outcomes['ok']} ok; the foreign thread made {cycles[0]:,} open/close cycles"
    )
    print(
        f"parent os.fork() call: median {statistics.median(fork_calls) * 1000:,.2f} ms, "
        f"max {max(fork_calls) * 1000:,.2f} ms"
    )


if __name__ == "__main__":
    main()
