"""Smoke test of an installed weft_sync (run by .ci/package.sh from a fresh venv, outside the
checkout): the package imports from the venv, ships its type marker, and its core works."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
import warnings
from importlib import resources
from pathlib import Path

import weft_sync
from weft_sync import EngineDeposedError, Ownership, OwnershipOptions, WorkflowClaimLostWarning

venv = Path(sys.argv[1]).resolve()
assert Path(weft_sync.__file__).resolve().is_relative_to(venv), weft_sync.__file__
assert resources.files("weft_sync").joinpath("py.typed").is_file(), "py.typed is not installed"

with tempfile.TemporaryDirectory() as tmp:
    url = f"sqlite:///{tmp}/smoke.db"
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    with Ownership.open(url, options=options) as owner:
        owner.workflows.start("wf-1", "job", input={"n": 1})
        owner.workflows.save_checkpoint("wf-1", b"half")
        with Ownership.open(url, options=options, background="manual") as other:
            other.workflows.cancel("wf-1")  # deposes the owner from outside
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                owner.workflows.save_checkpoint("wf-1", b"late")
            except EngineDeposedError:
                pass
            else:
                raise AssertionError("a deposed owner's write was accepted")
        assert any(issubclass(w.category, WorkflowClaimLostWarning) for w in caught), caught
        conn = sqlite3.connect(f"{tmp}/smoke.db", isolation_level=None)
        conn.execute("CREATE TABLE host (id TEXT PRIMARY KEY, v TEXT)")
        with owner.claim("bare-1"), owner.fenced("bare-1", conn):
            conn.execute("INSERT INTO host VALUES ('bare-1', 'fenced')")
        conn.close()
    listing = subprocess.run(
        [str(venv / "bin" / "weft-sync"), "--url", url, "workflows", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"cancelled"' in listing.stdout, listing.stdout
print(f"== smoke test passed: weft_sync {weft_sync.__version__} from {venv}")
