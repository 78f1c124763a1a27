"""Checks of the by-engine index invariant over a whole store (see weft_sync.claims.engine_index).

:func:`index_violations` reads every holder and every entry and lists each way the store breaks
the invariant: a decodable holder without its entry, an entry with another epoch, an entry no
holder backs.
"""

from __future__ import annotations

from weft_sync import keys
from weft_sync.codec import decode_epoch, decode_holder, encode_epoch
from weft_sync.storage import Storage

HOLDER_PREFIX = keys.workflow_owner_holder("")
ENTRY_PREFIX = keys.workflow_owner_by_engine_prefix("")


def expected_entries(storage: Storage) -> dict[str, bytes]:
    """The entry every decodable holder of the store calls for: ``{entry key: epoch bytes}``."""
    wanted: dict[str, bytes] = {}
    for key, value in storage.scan(HOLDER_PREFIX):
        workflow_id = keys.try_decode_key_component(key[len(HOLDER_PREFIX) :])
        holder = decode_holder(value)
        if workflow_id and holder is not None:
            wanted[keys.workflow_owner_by_engine(holder.engine_id, workflow_id)] = encode_epoch(
                holder.epoch
            )
    return wanted


def index_violations(storage: Storage) -> list[str]:
    """Every breach of the invariant, described; empty when the index is exact."""
    wanted = expected_entries(storage)
    present = dict(storage.scan(ENTRY_PREFIX))
    problems = [f"missing {key}" for key in sorted(wanted.keys() - present.keys())]
    problems += [f"unbacked {key}" for key in sorted(present.keys() - wanted.keys())]
    problems += [
        f"{key} holds epoch {decode_epoch(present[key])}, holder says {decode_epoch(value)}"
        for key, value in sorted(wanted.items())
        if key in present and present[key] != value
    ]
    return problems


def assert_index_exact(storage: Storage) -> None:
    """Fail naming every breach of the invariant."""
    problems = index_violations(storage)
    assert not problems, "by-engine index out of step with the holders: " + "; ".join(problems)


def entries(storage: Storage) -> dict[tuple[str, str], int | None]:
    """``{(engine id, workflow id): epoch}`` of every canonical entry in the store."""
    found: dict[tuple[str, str], int | None] = {}
    for key, value in storage.scan(ENTRY_PREFIX):
        names = keys.decode_owner_by_engine_key(key)
        assert names is not None, f"non-canonical entry key {key!r}"
        found[names] = decode_epoch(value)
    return found
