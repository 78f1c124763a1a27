"""Process-wide hooks: none at import; one fork hook from the first open; atexit while open.

Each check runs in a fresh interpreter that records every ``os.register_at_fork`` and
``atexit.register``/``unregister`` call made from the moment before ``weft_sync`` is imported,
and keeps those made by (or for) the library's modules: dependencies register their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.register_at_fork")

_RECORDER = """
import atexit, inspect, json, os, sys
calls = []
def caller():
    frame = inspect.currentframe().f_back.f_back
    return frame.f_globals.get("__name__", "?")
_real_fork, _real_register, _real_unregister = (
    os.register_at_fork, atexit.register, atexit.unregister
)
def fork_hook(**kw):
    calls.append(["fork", caller(), sorted(kw)])
    return _real_fork(**kw)
def register(fn, *a, **kw):
    calls.append(["atexit", getattr(fn, "__module__", "?") + "." + fn.__name__])
    return _real_register(fn, *a, **kw)
def unregister(fn):
    calls.append(["unregister", getattr(fn, "__module__", "?") + "." + fn.__name__])
    return _real_unregister(fn)
os.register_at_fork, atexit.register, atexit.unregister = fork_hook, register, unregister
def mark(label):
    calls.append(["mark", label])
def ours():
    return [c for c in calls if c[0] == "mark" or "weft_sync" in json.dumps(c)]
"""


def _python(script: str, tmp_path: Path) -> str:
    """Run ``script`` in a fresh interpreter that imports this checkout; return its output."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _run(body: str, tmp_path: Path) -> list[list[object]]:
    script = _RECORDER + textwrap.dedent(body) + "\nprint(json.dumps(ours()))\n"
    result: list[list[object]] = json.loads(_python(script, tmp_path).strip().splitlines()[-1])
    return result


def test_importing_every_module_registers_no_fork_hook_and_no_atexit_callback(
    tmp_path: Path,
) -> None:
    pytest.importorskip("django")
    pytest.importorskip("flask")
    calls = _run(
        """
        import importlib, pkgutil
        import django, django.conf
        django.conf.settings.configure(INSTALLED_APPS=[
            "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
            "django.contrib.messages", "django.contrib.sessions", "weft_sync.django",
        ])
        django.setup()
        import weft_sync
        names = [m.name for m in pkgutil.walk_packages(weft_sync.__path__, "weft_sync.")]
        for name in names:
            if not name.endswith("__main__"):  # runs the command line
                importlib.import_module(name)
        import weft_sync.django.runtime, weft_sync.flask
        from weft_sync import _fork
        mark("hook registered: " + str(_fork.hook_registered()))
        """,
        tmp_path,
    )
    assert calls == [["mark", "hook registered: False"]]


def test_importing_weft_sync_loads_no_openssl_so_a_hosts_forks_copy_less(tmp_path: Path) -> None:
    """``import weft_sync`` alone leaves ``hashlib`` (which maps OpenSSL's libcrypto, about
    4 MiB a fork must copy page tables for) unloaded; it is loaded where a hash is needed."""
    loaded = _python(
        "import sys; import weft_sync; "
        "print(sorted(m for m in ('hashlib', '_hashlib', 'hmac', 'secrets') if m in sys.modules))",
        tmp_path,
    )
    assert loaded.strip() == "[]"


def test_the_first_store_registers_one_fork_hook_and_a_fork_after_the_last_close_is_untouched(
    tmp_path: Path,
) -> None:
    calls = _run(
        """
        import os
        from weft_sync import Ownership, _fork
        from weft_sync.storage import SqliteStorage
        mark("imported")
        first = SqliteStorage("a.db")
        second = Ownership.open("sqlite:///b.db", background="manual")
        mark("opened")
        second.close()
        first.close()
        mark("tracked after close: " + str(len(_fork.tracked())))
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not _fork.tracked() else 3)
        _, status = os.waitpid(pid, 0)
        mark("child exit: " + str(os.waitstatus_to_exitcode(status)))
        """,
        tmp_path,
    )
    assert calls == [
        ["mark", "imported"],
        ["fork", "weft_sync._fork", ["after_in_child"]],
        ["mark", "opened"],
        ["mark", "tracked after close: 0"],
        ["mark", "child exit: 0"],
    ]


def test_flask_registers_its_exit_close_while_an_ownership_is_open(tmp_path: Path) -> None:
    pytest.importorskip("flask")
    calls = _run(
        """
        from flask import Flask
        from weft_sync.flask import WeftSync
        app = Flask("hooks")
        app.config["WEFT_SYNC_URL"] = "sqlite:///flask.db"
        app.config["WEFT_SYNC_BACKGROUND"] = "manual"
        weft = WeftSync(app)
        mark("initialised")
        weft.get_ownership(app)
        mark("opened")
        weft.close(app)
        mark("closed")
        """,
        tmp_path,
    )
    exits = [c for c in calls if c[0] != "fork"]
    assert exits == [
        ["mark", "initialised"],
        ["atexit", "weft_sync.flask.close_all"],
        ["mark", "opened"],
        ["unregister", "weft_sync.flask.close_all"],
        ["mark", "closed"],
    ]
