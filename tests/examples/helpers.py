"""Helpers of the example tests: load or run an example, and leave abandoned workflows behind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from weft_sync import ManualClock, Ownership, system_clock

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
WAIT_S = 30.0
"""Upper bound for one example process; reaching it means the test failed."""
HOUR_MS = 3_600_000


def load_example(relative_path: str) -> ModuleType:
    """Import ``examples/<relative_path>`` as a module (once per test session)."""
    path = EXAMPLES / relative_path
    name = "weft_example_" + "_".join(Path(relative_path).with_suffix("").parts)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def script_env() -> dict[str, str]:
    """The environment of an example process: this checkout importable, no inherited store."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("WEFT_SYNC_URL", "DJANGO_SETTINGS_MODULE")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def script_command(relative_path: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / relative_path), *args]


def run_script(
    relative_path: str, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python examples/<relative_path> ARGS`` to completion."""
    return subprocess.run(
        script_command(relative_path, *args),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=script_env(),
        cwd=cwd,
        check=False,
    )


def abandon(
    url: str,
    workflow_id: str,
    workflow_type: str,
    *,
    input: Any = None,
    checkpoint: bytes | None = None,
) -> None:
    """Leave a running workflow whose process died an hour ago, claim unreleased.

    Its engine ran on a ``ManualClock`` an hour behind the wall clock, so the holder it wrote
    expired long ago for every process reading the wall clock.
    """
    clock = ManualClock(system_clock() - HOUR_MS)
    with Ownership.open(url, background="manual", clock=clock, engine_id="dead-engine") as dead:
        dead.workflows.start(workflow_id, workflow_type, input=input)
        if checkpoint is not None:
            dead.workflows.save_checkpoint(workflow_id, checkpoint)
        dead.registry.forget_local_claim(workflow_id)
