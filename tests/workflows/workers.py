"""Entry points of the child processes of the workflow tests (importable by a spawned child)."""

from __future__ import annotations

from weft_sync.clock import system_clock
from weft_sync.storage import open_storage
from weft_sync.workflows import Workflows


def send_signals(storage_url: str, workflow_id: str, name: str, sender: str, count: int) -> None:
    """Send ``count`` signals ``name``, payloads ``"<sender>-<n>"``, from a registry-less ledger."""
    storage = open_storage(storage_url)
    try:
        client = Workflows(storage, None, clock=system_clock)
        for n in range(count):
            client.send_signal(workflow_id, name, f"{sender}-{n}")
    finally:
        storage.close()
