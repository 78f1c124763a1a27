"""Argument checks shared by the claim registry's entry points."""

from __future__ import annotations

from collections.abc import Container, Iterable
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


def engine_ids_arg(engine_ids: Iterable[str]) -> frozenset[str]:
    """Validate a collection of engine ids (``dead_engines=``); return it as a frozenset."""
    if isinstance(engine_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"dead_engines must be a collection of engine ids such as a set, got the "
            f"{type(engine_ids).__name__} {engine_ids!r:.80}; pass {{{engine_ids!r:.80}}} for "
            f"one engine"
        )
    ids = frozenset(engine_ids)
    for engine_id in ids:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"dead_engines must hold non-empty str engine ids, got {engine_id!r}")
    return ids
