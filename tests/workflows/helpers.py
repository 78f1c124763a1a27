"""Assertions and small tools shared by the workflow-ledger tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tests.claims.gated import GatedStorage
from weft_sync import keys
from weft_sync.codec import decode_epoch, decode_holder, try_decode_workflow_record
from weft_sync.errors import StorageError
from weft_sync.storage import Storage

WAIT_S = 10.0
"""Upper bound for any wait in these tests; reaching it means the test failed."""


def snapshot(storage: Storage) -> dict[str, bytes]:
    """Every key and value in the store."""
    return dict(storage.scan(""))


def records(storage: Storage) -> dict[str, str]:
    """``{workflow id: status}`` of every workflow record (related records skipped)."""
    found: dict[str, str] = {}
    for key, value in storage.scan(keys.workflow("")):
        component = key[len(keys.workflow("")) :]
        if ":" in component:
            continue
        record = try_decode_workflow_record(value)
        assert record is not None, f"corrupt record under {key!r}"
        found[keys.decode_key_component(component)] = record.status
    return found


def index_entries(storage: Storage) -> set[tuple[str, str]]:
    """``{(status, workflow id)}`` of every status-index entry."""
    prefix = "wf-idx-status:"
    found: set[tuple[str, str]] = set()
    for key, value in storage.scan(prefix):
        assert value == b""
        status, workflow_id = key[len(prefix) :].split(":")
        found.add((keys.decode_key_component(status), keys.decode_key_component(workflow_id)))
    return found


def assert_index_matches_records(storage: Storage) -> None:
    """The status index holds exactly one entry per record, under the record's status."""
    assert index_entries(storage) == {(s, w) for w, s in records(storage).items()}


def stored_epoch(storage: Storage, workflow_id: str) -> int | None:
    return decode_epoch(storage.get(keys.workflow_owner_epoch(workflow_id)))


def holder_engine(storage: Storage, workflow_id: str) -> str | None:
    holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    return None if holder is None else holder.engine_id


def expires_at(storage: Storage, workflow_id: str) -> int | None:
    holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    return None if holder is None else holder.expires_at


class ReadHooks(GatedStorage):
    """A gated store that can also fail reads of one key, or run callbacks around one read."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        # _hooks_lock guards _failing, _before and _after_scan.
        self._hooks_lock = threading.Lock()
        self._failing: set[str] = set()
        self._before: dict[str, Callable[[], object]] = {}
        self._after_scan: dict[str, tuple[Callable[[], object], str | None]] = {}

    def after_next_scan_of(
        self, prefix: str, callback: Callable[[], object], *, thread_name: str | None = None
    ) -> None:
        """Run ``callback`` once, right after the next ``scan(prefix)`` returned its rows.

        :param thread_name: only a scan made by the thread of this name counts.
        """
        with self._hooks_lock:
            self._after_scan[prefix] = (callback, thread_name)

    def scan(self, prefix: str = "", **kwargs: Any) -> list[tuple[str, bytes]]:
        rows = super().scan(prefix, **kwargs)
        name = threading.current_thread().name
        with self._hooks_lock:
            hook = self._after_scan.get(prefix)
            if hook is not None and hook[1] in (None, name):
                del self._after_scan[prefix]
            else:
                hook = None
        if hook is not None:
            hook[0]()
        return rows

    def fail_reads_of(self, key: str) -> None:
        """Make every later ``get(key)`` raise ``StorageError``."""
        with self._hooks_lock:
            self._failing.add(key)

    def before_next_read_of(self, key: str, callback: Callable[[], object]) -> None:
        """Run ``callback`` once, just before the next ``get(key)``."""
        with self._hooks_lock:
            self._before[key] = callback

    def get(self, key: str) -> bytes | None:
        with self._hooks_lock:
            failing = key in self._failing
            callback = self._before.pop(key, None)
        if failing:
            raise StorageError(f"cannot read {key!r}")
        if callback is not None:
            callback()
        return super().get(key)
