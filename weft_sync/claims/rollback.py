"""Noticing a store that went back in time, from what this engine last wrote there.

Epoch numbers only grow: every mint writes the observed number plus one, with a fresh random
mint id, and the epoch key is never deleted. So when a write this engine fenced on its own token
fails, what the store holds instead says how it got there:

* a **higher** number, or no holder: another owner minted after ours, or an external
  cancel/suspend/purge deposed us — an ordinary deposition;
* a **lower** number, the **same number with another mint id** (the number was minted a second
  time), an old-format epoch where we minted a token, or **no epoch key at all**: the store lost
  writes it had acknowledged — a restore of an older copy in place, or a failover to a replica
  that lacked the last writes;
* our **own token** with a holder of **this engine** that is older than the one we last wrote
  (an earlier ``expires_at`` or ``claimed_at``): the store lost our renewals — the same event.

:func:`rollback_evidence` makes that judgement from values read after a failed renewal or
fenced write, so it costs nothing while every write succeeds. When it finds a rollback the
registry loses every claim locally with cause ``store_rollback``: nothing the engine remembers
about that store can be trusted, and the fences (exact token bytes) already refuse the writes
of every claim whose minting the store forgot.
"""

from __future__ import annotations

from ..codec import decode_holder, decode_token
from ..redaction import redact_text


def rollback_evidence(
    *,
    engine_id: str,
    held_token: bytes,
    held_holder: bytes | None,
    observed_token: bytes | None,
    observed_holder: bytes | None,
) -> str | None:
    """Say why the observed values show the store went back in time, or ``None``.

    :param engine_id: this engine's id.
    :param held_token: the epoch-key bytes this engine minted and holds.
    :param held_holder: the holder bytes it last wrote (``None``: not judged on the holder).
    :param observed_token: the epoch key as read now (``None``: absent).
    :param observed_holder: the holder key as read now (``None``: absent or not read).
    :returns: a short description of the evidence, for the warning; ``None`` for anything an
        ordinary deposition (or a corrupt value) explains.
    """
    held = decode_token(held_token)
    if held is None:
        return None
    if observed_token is None:
        return f"the epoch key is gone, though this engine minted epoch {held.epoch} there"
    seen = decode_token(observed_token)
    if seen is None:
        return None  # corrupt: refused as such, not judged here
    if seen.epoch < held.epoch:
        return f"the epoch went back from {held.epoch} to {seen.epoch}"
    if seen.epoch > held.epoch:
        return None
    if observed_token != held_token:
        return f"epoch {held.epoch} was minted a second time"
    if held_holder is None or observed_holder is None or observed_holder == held_holder:
        return None
    mine, found = decode_holder(held_holder), decode_holder(observed_holder)
    if mine is None or found is None or found.engine_id != engine_id:
        return None
    if found.claimed_at < mine.claimed_at or found.expires_at < mine.expires_at:
        return (
            f"this engine's holder record of epoch {held.epoch} went back to an older one "
            f"(expiry {found.expires_at} < {mine.expires_at})"
        )
    return None


def describe_store(storage: object) -> str:
    """Name a store for a message, with any password masked."""
    return redact_text(repr(storage))
