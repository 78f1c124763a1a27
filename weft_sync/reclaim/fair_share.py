"""Fair takeover: how many stranded workflows one engine takes over in a pass, and which ones.

When an engine dies, every survivor's reclaim pass sees the same stranded claims. Batched takeover
is fast enough that the first survivor to run a pass would take them all, so each pass takes at
most a *fair share*, and each engine takes its candidates in its own order so that survivors
running passes at the same moment mostly attempt different workflows.

The share is computed from what discovery read: with ``n`` engines (this one included) that
hold live claims or publish a fresh engine record (idle ones count through their records) and
``total`` claims among them plus the stranded ones, an engine aims to hold ``ceil(total / n)``;
it takes what it lacks of that target, and at least
``ceil(stranded / n)`` so that the stranded count shrinks every pass whoever is counted. A
survivor alone (``n == 1``) takes everything at once.

A stranded workflow left over by the other engines (seen stranded by this engine for
:data:`FAIR_SHARE_WINDOW_INTERVALS` renew intervals) is taken regardless of the share: engines
that hold claims but reclaim nothing still count in ``n``, and they must not be able to delay a
takeover for longer than that window. Candidates the reclaim target already found ineligible
(no handler here) are left out of the share, so a heap of workflows nobody here can drive never
uses it up. ``max_claims`` caps everything.

The claims of a *crashed or closed* engine are split differently (:func:`assigned_to`): every
survivor that watches for crashes sees the same crash and the same watching engines, so
rendezvous hashing gives each a disjoint share at once, and the shares cover every claim.

The limits: an engine without an engine record (an older version) is seen only through the
claims it holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

FAIR_SHARE_WINDOW_INTERVALS: Final = 2
"""Renew intervals a stranded workflow waits for its fair-share taker before anyone takes it."""


def validate_max_claims(max_claims: object) -> int | None:
    """Return ``max_claims`` if it is ``None`` or an ``int >= 1``.

    :raises ValueError: anything else, naming the value.
    """
    if max_claims is None:
        return None
    if isinstance(max_claims, bool) or not isinstance(max_claims, int) or max_claims < 1:
        raise ValueError(
            f"max_claims must be a whole number >= 1 or None (no limit), got "
            f"{type(max_claims).__name__} {max_claims!r}"
        )
    return max_claims


def _digest(data: bytes) -> bytes:
    """An 8-byte BLAKE2b digest of ``data``: the rank every engine computes alike."""
    # Imported here, not at the top: hashlib loads OpenSSL, whose memory every os.fork() of a
    # host that merely imported weft_sync would then copy.
    import hashlib

    return hashlib.blake2b(data, digest_size=8).digest()


def takeover_order(engine_id: str, workflow_ids: Iterable[str]) -> list[str]:
    """``workflow_ids`` in an order that is fixed for ``engine_id`` and differs between engines."""
    prefix = engine_id.encode() + b"\0"

    def rank(workflow_id: str) -> bytes:
        return _digest(prefix + workflow_id.encode())

    return sorted(workflow_ids, key=rank)


def assigned_to(
    engine_id: str, participants: Iterable[str], workflow_ids: Iterable[str]
) -> list[str]:
    """The ``workflow_ids`` that rendezvous hashing assigns to ``engine_id`` among ``participants``.

    Every engine that computes this over the same participants gets a disjoint share, and the
    shares together cover every id: a crashed engine's claims are split in one round, without
    two survivors racing for the same claim. ``engine_id`` always takes part.
    """
    engines = sorted(set(participants) | {engine_id})
    if len(engines) == 1:
        return list(workflow_ids)

    def winner(workflow_id: str) -> str:
        tail = b"\0" + workflow_id.encode()
        return max(
            engines,
            key=lambda e: _digest(e.encode() + tail),
        )

    return [wid for wid in workflow_ids if winner(wid) == engine_id]


def takeover_budget(
    *,
    stranded: int,
    held: int,
    live_claims: Mapping[str, int],
    engine_id: str,
    max_claims: int | None,
) -> int:
    """How many of ``stranded`` workflows this engine takes over in one pass.

    :param stranded: the stranded candidates of this pass.
    :param held: the claims this engine holds now.
    :param live_claims: other engines' live claims, per engine id (an entry for ``engine_id``
        is ignored: ``held`` is exact).
    :param max_claims: this engine's limit, or ``None``.
    """
    if stranded <= 0:
        return 0
    others = {engine: count for engine, count in live_claims.items() if engine != engine_id}
    engines = len(others) + 1
    target = math.ceil((sum(others.values()) + held + stranded) / engines)
    share = max(target - held, math.ceil(stranded / engines))
    return min(share, stranded, _capacity(held, max_claims))


def select_takeovers(
    *,
    engine_id: str,
    stranded: list[str],
    overdue: set[str],
    held: int,
    live_claims: Mapping[str, int],
    max_claims: int | None,
) -> list[str]:
    """The stranded workflows to attempt this pass: overdue ones first, then this engine's share.

    :param stranded: this pass's stranded candidates.
    :param overdue: those waiting longer than the fair-share window (taken whatever the share).
    """
    ordered = takeover_order(engine_id, stranded)
    late = [wid for wid in ordered if wid in overdue]
    fresh = [wid for wid in ordered if wid not in overdue]
    budget = takeover_budget(
        stranded=len(stranded),
        held=held,
        live_claims=live_claims,
        engine_id=engine_id,
        max_claims=max_claims,
    )
    take = min(max(budget, len(late)), _capacity(held, max_claims))
    return (late + fresh)[:take]


def _capacity(held: int, max_claims: int | None) -> int:
    if max_claims is None:
        return 1 << 62
    return max(0, max_claims - held)
