"""A process killed between the app's final write and the workflow's end leaves neither.

A real process writes the host's final row and calls ``complete()`` inside one fenced block
(sqlite3 on SQLite, psycopg on PostgreSQL), then is SIGKILLed before the block commits; or after
it committed. The host row and the store agree in every run: both written, or neither (the
workflow still running, its claim left to expire for a redrive).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fencing.hosts import HostEnv
from weft_sync import Ownership, OwnershipOptions

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, signal, sqlite3, sys
from weft_sync import Ownership, OwnershipOptions

storage_url, db_url, table, backend, when = sys.argv[1:6]
options = OwnershipOptions(claim_ttl=3000, claim_renew_interval=1000)
own = Ownership.open(storage_url, options=options, background="manual")
own.workflows.start("job-1", "report")
if backend == "sqlite":
    conn = sqlite3.connect(db_url)
    mark = "?"
else:
    import psycopg
    conn = psycopg.connect(db_url)
    mark = "%s"
with own.fenced("job-1", conn) as handle:
    cur = handle.cursor()
    cur.execute(f"INSERT INTO {table} (id, v) VALUES ({mark}, {mark})", ("report-1", "final"))
    own.workflows.complete("job-1", {"rows": 1})
    if when == "before-commit":
        os.kill(os.getpid(), signal.SIGKILL)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_a_kill_around_the_final_transaction_leaves_the_app_row_and_the_store_agreeing(
    raw_env: HostEnv, when: str
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            raw_env.storage_url,
            raw_env.db_url,
            raw_env.table,
            raw_env.backend,
            when,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    with Ownership.open(
        raw_env.storage_url,
        options=OwnershipOptions(claim_ttl=3000, claim_renew_interval=1000),
        background="manual",
    ) as reader:
        record = reader.workflows.get("job-1")
        assert record is not None
        rows = raw_env.rows()
        if when == "before-commit":
            assert (rows, record.status) == ({}, "running")
        else:
            assert (rows, record.status) == ({"report-1": "final"}, "completed")
