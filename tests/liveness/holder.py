"""A child process that holds a session lock (or runs an engine's liveness) until it is killed.

``python -m tests.liveness.holder URL NAME MODE`` prints one line once the lock is held and
then sleeps until killed (or until its stdin closes). Modes:

- ``lock``: take the session lock ``NAME``;
- ``engine``: start an :class:`~weft_sync.reclaim.engine_liveness.EngineLiveness` with engine
  id ``NAME``;
- ``fork``: take the lock, fork a child that exits at once and another that sleeps; the line
  printed is ``ready <pid of the sleeping child>``;
- ``exec``: take the lock, start ``sleep`` without closing inherited descriptors (only
  close-on-exec ones go); the line printed is ``ready <pid of sleep>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from weft_sync.clock import system_clock
from weft_sync.storage import open_storage
from weft_sync.storage.session_locks import storage_session_locks


def _fork_children() -> int:
    quick = os.fork()
    if quick == 0:
        os._exit(0)
    os.waitpid(quick, 0)
    sleeper = os.fork()
    if sleeper == 0:
        # Let go of the test's pipes, so that waiting for the parent never waits for this child.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        time.sleep(120)
        os._exit(0)
    return sleeper


def main(url: str, name: str, mode: str) -> None:
    storage = open_storage(url)
    keep: object
    if mode == "engine":
        from weft_sync.reclaim.engine_liveness import EngineLiveness

        liveness = EngineLiveness(
            storage,
            engine_id=name,
            clock=system_clock,
            claim_ttl_ms=30_000,
            renew_interval_ms=5_000,
        )
        liveness.start()
        keep = liveness
    else:
        locks = storage_session_locks(storage)
        assert locks is not None
        keep = locks.acquire_session_lock(name)
    line = "ready"
    if mode == "fork":
        line = f"ready {_fork_children()}"
    elif mode == "exec":
        sleeper = subprocess.Popen(
            ["sleep", "120"],
            close_fds=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        line = f"ready {sleeper.pid}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    del keep


if __name__ == "__main__":
    main(*sys.argv[1:4])
