"""Child processes of the multi-process tests: spawning, files, journals, and the store they share.

A child talks to the test only through files: a journal (JSON lines appended with ``os.write``, so
every line written before a SIGKILL survives it), a "go" file the test creates once every child
is ready, and a "stop" file that ends the run. The child side (:class:`Journal`,
:func:`run_journaled`, :func:`log_warnings_to`, :func:`wait_for_go`) is imported by freshly
spawned interpreters; the test side spawns, watches, stops and kills them.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

from weft_sync import keys
from weft_sync.codec import decode_epoch, decode_holder
from weft_sync.storage import Storage

EXIT_TIMEOUT_S = 30.0
"""Upper bound for a child to end after the stop file or a signal."""

Event = dict[str, Any]
"""One journal line."""
_C = TypeVar("_C")

# -- child side ------------------------------------------------------------------------------


class Journal:
    """An append-only JSON-lines file; each line reaches the kernel before ``write`` returns."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: Event) -> None:
        os.write(self._fd, (json.dumps(event) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def run_journaled(journal_path: str, body: Callable[[Journal], None]) -> None:
    """Run a child's ``body`` with its journal open; journal a traceback before re-raising."""
    journal = Journal(journal_path)
    try:
        body(journal)
    except BaseException:
        journal.write({"ev": "error", "traceback": traceback.format_exc()})
        raise
    finally:
        journal.close()


def log_warnings_to(path: str) -> None:
    """Send the library's warnings (skipped ticks on a loaded machine, lost claims) to ``path``.

    The file stays in the test's ``tmp_path``, off the test run's stderr.
    """
    logging.basicConfig(
        filename=path,
        level=logging.WARNING,
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )


def wait_for_go(path: str, timeout_s: float, poll_s: float) -> None:
    """Block until the go file ``path`` exists; :class:`TimeoutError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the go file {path!r} never appeared")
        time.sleep(poll_s)


# -- test side -------------------------------------------------------------------------------


def read_journal(path: str) -> list[Event]:
    """Every complete line of a journal (a line cut short by SIGKILL is dropped; none yet: [])."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def journal_has(path: str, kind: str) -> bool:
    """Whether the journal at ``path`` holds an event of kind ``kind`` (``"ready"``, ...)."""
    return any(e["ev"] == kind for e in read_journal(path))


def journal_errors(path: str) -> list[str]:
    """The tracebacks :func:`run_journaled` recorded in the journal at ``path``."""
    return [e["traceback"] for e in read_journal(path) if e["ev"] == "error"]


def spawn(target: Callable[[_C], None], config: _C, name: str) -> BaseProcess:
    """Start ``target(config)`` in a freshly spawned interpreter: a daemon named ``weft-<name>``."""
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=(config,), name=f"weft-{name}", daemon=True
    )
    process.start()
    return process


def wait_ready(
    name: str, journal_path: str, deadline: float, poll_s: float, check: Callable[[], None]
) -> None:
    """Wait until child ``name`` journals ``ready``; ``check`` (which may fail) runs each poll."""
    while not journal_has(journal_path, "ready"):
        check()
        assert time.monotonic() < deadline, f"{name} never became ready"
        time.sleep(poll_s)


def sigkill(process: BaseProcess, name: str) -> None:
    """SIGKILL a live child and reap it, checking that the signal is what ended it."""
    assert process.pid is not None and process.is_alive(), f"{name} is not running"
    os.kill(process.pid, signal.SIGKILL)
    process.join(EXIT_TIMEOUT_S)
    assert process.exitcode == -signal.SIGKILL, (
        f"{name} ended with {process.exitcode}, not by the SIGKILL"
    )


def stop_all(processes: Iterable[BaseProcess], stop_path: Path) -> None:
    """Give the stop signal, let frozen children run, and kill whoever does not end in time."""
    processes = list(processes)
    stop_path.touch()
    for process in processes:
        if process.exitcode is None and process.pid is not None:
            os.kill(process.pid, signal.SIGCONT)
    for process in processes:
        process.join(EXIT_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(EXIT_TIMEOUT_S)


def holders(storage: Storage) -> dict[str, tuple[str, int]]:
    """``{workflow id: (engine id, epoch)}`` of every readable holder."""
    prefix = keys.workflow_owner_holder("")
    found: dict[str, tuple[str, int]] = {}
    for key, value in storage.scan(prefix):
        holder = decode_holder(value)
        if holder is not None:
            found[keys.decode_key_component(key[len(prefix) :])] = (holder.engine_id, holder.epoch)
    return found


def epochs(storage: Storage) -> dict[str, int]:
    """``{workflow id: epoch}`` of every epoch key (read in one scan)."""
    prefix = keys.workflow_owner_epoch("")
    found: dict[str, int] = {}
    for key, value in storage.scan(prefix):
        epoch = decode_epoch(value)
        assert epoch is not None, f"undecodable epoch under {key!r}"
        found[keys.decode_key_component(key[len(prefix) :])] = epoch
    return found


def tokens(storage: Storage) -> dict[str, bytes]:
    """``{workflow id: fencing token}``: the exact bytes of every epoch key (read in one scan)."""
    prefix = keys.workflow_owner_epoch("")
    return {
        keys.decode_key_component(key[len(prefix) :]): bytes(value)
        for key, value in storage.scan(prefix)
    }
