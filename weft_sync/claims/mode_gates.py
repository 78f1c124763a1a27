"""Construction gates: refuse a store that cannot fence, or whose engines run another mode.

Both gates run before any claim is acquired, any recovery scan or any poll, on every path that
builds an engine. Mode ``"none"`` skips them without touching the store. For ``"lease"`` and
``"workflow-lease"``:

1. the store must declare the ``conditional_batch`` capability (a compare-and-swap on exact bytes);
2. the store-wide mode marker must name the configured mode; a fresh store is stamped with it.

``"lease"`` and ``"workflow-lease"`` engines fence different keys, so one store must never serve
both at once; the marker makes a mixed fleet fail at start-up instead of corrupting ownership.
"""

from __future__ import annotations

import logging
from typing import Final, Literal, get_args

from ..clock import Clock
from ..codec import ModeMarker, decode_mode_marker, encode_mode_marker
from ..errors import CorruptOwnershipMarkerError, OwnershipModeMismatchError, StorageCapabilityError
from ..keys import OWNERSHIP_MODE_MARKER
from ..storage.base import Condition, Put, Storage, storage_conditional_batch
from .engine_index import mark_newborn_store

_log = logging.getLogger(__name__)

OwnershipModeName = Literal["none", "lease", "workflow-lease"]
OWNERSHIP_MODES: Final[tuple[str, ...]] = get_args(OwnershipModeName)


def _check_mode(mode: object) -> OwnershipModeName:
    if not isinstance(mode, str) or mode not in OWNERSHIP_MODES:
        raise ValueError(
            f"unknown ownership mode {mode!r}; valid modes are "
            f"{', '.join(repr(m) for m in OWNERSHIP_MODES)}"
        )
    return mode  # type: ignore[return-value]


def bootstrap_ownership_gates(storage: Storage, *, mode: OwnershipModeName, clock: Clock) -> None:
    """Run both gates for ``mode``; mode ``"none"`` returns without touching the store.

    :param storage: the store the engine will use.
    :param mode: the configured ownership mode.
    :param clock: supplies ``established_at`` when this call stamps a fresh store.
    :raises ValueError: ``mode`` is not a valid mode (checked before any storage access).
    :raises StorageCapabilityError: the store cannot do a compare-and-swap (nothing is written).
    :raises OwnershipModeMismatchError: the store was stamped with the other fencing mode.
    :raises CorruptOwnershipMarkerError: the marker exists but is unreadable, or vanished while
        this call was stamping it.
    """
    checked = _check_mode(mode)
    if checked == "none":
        return
    assert_ownership_storage_capability(storage, checked)
    assert_ownership_mode_marker(storage, mode=checked, clock=clock)


def assert_ownership_storage_capability(storage: Storage, mode: OwnershipModeName) -> None:
    """Gate 1: ``storage`` must declare ``conditional_batch`` when ``mode`` fences.

    :raises StorageCapabilityError: the capability is missing; the message names ``mode``.
    :raises ValueError: ``mode`` is not a valid mode.
    """
    checked = _check_mode(mode)
    if checked == "none":
        return
    if not storage.capabilities.conditional_batch:
        raise StorageCapabilityError(
            f"ownership: {checked!r}",
            "conditional_batch",
            f"ownership mode {checked!r} fences writes with a compare-and-swap on exact bytes; "
            f"use a SQLite or PostgreSQL store without value-transforming wrappers, or "
            f"ownership mode 'none'",
        )


def assert_ownership_mode_marker(
    storage: Storage, *, mode: OwnershipModeName, clock: Clock
) -> None:
    """Gate 2: the store's mode marker must name ``mode``; stamp it on a fresh store.

    A present, valid marker is never rewritten; a present but undecodable one is never
    overwritten (fail closed: an operator must repair it).

    :raises OwnershipModeMismatchError: the marker names another mode.
    :raises CorruptOwnershipMarkerError: the marker does not decode, or it was deleted between a
        lost stamping race and the re-read.
    :raises ValueError: ``mode`` is not a valid mode.
    """
    checked = _check_mode(mode)
    if checked == "none":
        return
    raw = storage.get(OWNERSHIP_MODE_MARKER)
    if raw is not None:
        _compare_marker(raw, checked)
        return
    marker = encode_mode_marker(ModeMarker(checked, clock()))
    stamped = storage_conditional_batch(
        storage, [Condition(OWNERSHIP_MODE_MARKER, None)], [Put(OWNERSHIP_MODE_MARKER, marker)]
    )
    if stamped:
        _log.info("stamped the store with ownership mode %r", checked)
        # A store stamped here is new: born with its by-engine index marker when it holds no
        # claim yet (see mark_newborn_store), so its first claims never cost full scans.
        mark_newborn_store(storage, clock())
        return
    raw = storage.get(OWNERSHIP_MODE_MARKER)
    if raw is None:
        raise CorruptOwnershipMarkerError(
            f"the ownership-mode marker {OWNERSHIP_MODE_MARKER!r} was written by another process "
            f"while this one stamped it, and was found absent again on re-read (deleted "
            f"concurrently); refusing to start with mode {checked!r}: retry once the operator "
            f"has finished changing it"
        )
    _compare_marker(raw, checked)


def _compare_marker(raw: bytes, mode: Literal["lease", "workflow-lease"]) -> None:
    stored = decode_mode_marker(raw)
    if stored is None:
        raise CorruptOwnershipMarkerError(
            f"the ownership-mode marker {OWNERSHIP_MODE_MARKER!r} exists but does not decode as "
            f"a valid {{mode, established_at}} record ({raw[:60]!r}); refusing to start with "
            f"mode {mode!r}; an operator must repair or delete it while no process runs"
        )
    if stored.mode != mode:
        raise OwnershipModeMismatchError(mode, stored.mode, stored.established_at)
