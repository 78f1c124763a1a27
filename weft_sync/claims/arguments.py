"""Argument checks shared by the claim registry's entry points."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Final

from ..keys import validate_workflow_id

_STR: Final = frozenset([str])


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int (milliseconds), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int number of milliseconds, got {value!r}")
    return value


def optional_epoch(expected_epoch: object) -> int | None:
    """``expected_epoch`` if it is an int or ``None``, else ``TypeError``."""
    if expected_epoch is not None and (
        isinstance(expected_epoch, bool) or not isinstance(expected_epoch, int)
    ):
        raise TypeError(f"expected_epoch must be an int or None, got {expected_epoch!r}")
    return expected_epoch


def workflow_ids_arg(workflow_ids: Iterable[str], tracked: Container[str] = ()) -> list[str]:
    """Validate ``workflow_ids``; ids found in ``tracked`` were validated when they were claimed."""
    # A str (or bytes) is iterable too: renewing its characters is never what the caller meant.
    if isinstance(workflow_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"workflow_ids must be an iterable of workflow ids such as a list, got the "
            f"{type(workflow_ids).__name__} {workflow_ids!r:.80}; pass [{workflow_ids!r:.80}] "
            f"to renew one workflow"
        )
    ids = list(workflow_ids)
    # Checked in bulk first (the loops run in C): usually every id is a tracked str.
    if set(map(type, ids)) <= _STR and all(map(tracked.__contains__, ids)):
        return ids
    return [w if type(w) is str and w in tracked else validate_workflow_id(w) for w in ids]


def dead_engines_arg(dead_engines: Iterable[str]) -> dict[str, bytes | None]:
    """Validate ``dead_engines=``: engine ids, or a mapping of engine id -> record bytes.

    :returns: each engine id with the exact engine-record bytes its death was judged on, or
        ``None`` for an id given without them (the caller's word).
    """
    if isinstance(dead_engines, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"dead_engines must be a collection of engine ids such as a set, got the "
            f"{type(dead_engines).__name__} {dead_engines!r:.80}; pass {{{dead_engines!r:.80}}} "
            f"for one engine"
        )
    if isinstance(dead_engines, Mapping):
        judged: dict[str, bytes | None] = {}
        for engine_id, record in dead_engines.items():
            if not isinstance(record, bytes):
                raise TypeError(
                    f"dead_engines maps engine ids to the bytes of the engine record their "
                    f"death was judged on, got {record!r:.80} for {engine_id!r:.80}"
                )
            judged[engine_id] = record
    else:
        judged = dict.fromkeys(dead_engines)
    for engine_id in judged:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"dead_engines must hold non-empty str engine ids, got {engine_id!r}")
    return judged
