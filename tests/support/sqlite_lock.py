"""A script that holds a SQLite database's write lock from a process of its own.

Run it as ``[sys.executable, "-c", HOLD_WRITE_LOCK, <database path>, <seconds>]`` with pipes on
its stdin and stdout (text mode). It takes the lock (``BEGIN IMMEDIATE``), prints ``locked``,
holds the lock for ``<seconds>`` and then until it reads a line (or the end) of its stdin, rolls
back and exits 0. Writes of other connections wait behind it as behind any writer, up to their
busy timeout.
"""

from __future__ import annotations

from typing import Final

HOLD_WRITE_LOCK: Final = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
sys.stdin.readline()  # held on until the test says so
conn.execute("ROLLBACK")
conn.close()
"""
