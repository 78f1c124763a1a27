"""Matching epoch tokens in assertions: a minted token carries a random mint id.

``minted(n)`` compares equal to any full token (number and mint id) of epoch ``n``, so a test
can state "epoch 2 was minted here" where it used to compare against ``encode_epoch(2)``.
``epoch_numbers`` turns a store dump into one whose epoch values are their numbers, so two
stores that made the same mints compare equal.
"""

from __future__ import annotations

from collections.abc import Iterable

from weft_sync import keys
from weft_sync.codec import EPOCH_TOKEN_SIZE, decode_epoch


class minted:
    """Equal to any epoch token of number ``epoch`` (never to an old-format 8-byte epoch)."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, bytes)
            and len(other) == EPOCH_TOKEN_SIZE
            and decode_epoch(other) == self.epoch
        )

    def __hash__(self) -> int:
        return hash(self.epoch)

    def __repr__(self) -> str:
        return f"minted({self.epoch})"


def epoch_numbers(rows: Iterable[tuple[str, bytes]]) -> list[tuple[str, object]]:
    """``rows`` with each epoch key's value replaced by its epoch number."""
    prefix = keys.workflow_owner_epoch("")
    return [(k, decode_epoch(v) if k.startswith(prefix) else v) for k, v in rows]


def token_shape(value: bytes | None) -> tuple[int | None, int] | None:
    """An epoch value as ``(number, size)``: what two stores making the same mints share."""
    return None if value is None else (decode_epoch(value), len(value))
