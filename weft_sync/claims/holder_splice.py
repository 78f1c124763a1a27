"""Where a holder record's ``expires_at`` value sits, so that a renewal can splice a new one in.

A renewal changes only ``expires_at``; the bytes before and after its packed value stay as they
are. Splicing a newly packed value between them is byte for byte what encoding the whole record
again gives, and much cheaper.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import msgpack

from ..codec import decode_holder, encode_holder

_PACKED_EXPIRES_AT_KEY: Final = msgpack.packb("expires_at")


def renewal_split(holder_bytes: bytes) -> tuple[int, int]:
    """Return ``(head_len, tail_len)`` around the packed ``expires_at`` value, or ``(0, 0)``.

    Both are positive when a split is found: the record's other fields are packed around it.

    Splicing a packed value between the head and the tail must give exactly what
    ``encode_holder`` gives for that value; this is checked here on a probe value, so a holder
    this cannot be shown for is renewed through ``build_renew_transition`` instead.
    """
    record = decode_holder(holder_bytes)
    if record is None or encode_holder(record) != holder_bytes:
        return 0, 0
    marker = _PACKED_EXPIRES_AT_KEY + msgpack.packb(record.expires_at)
    at = holder_bytes.find(marker)
    if at < 0 or holder_bytes.find(marker, at + 1) >= 0:
        return 0, 0
    head_len = at + len(_PACKED_EXPIRES_AT_KEY)
    tail_len = len(holder_bytes) - at - len(marker)
    if tail_len <= 0:
        return 0, 0
    probe = record.expires_at - 1 if record.expires_at > 0 else 1
    spliced = holder_bytes[:head_len] + msgpack.packb(probe) + holder_bytes[at + len(marker) :]
    if spliced != encode_holder(dataclasses.replace(record, expires_at=probe)):
        return 0, 0
    return head_len, tail_len
