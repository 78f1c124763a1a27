"""What a reclaim discovery returns, and the full-scan discovery every store supports."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from ..claims.transitions import is_claim_expired
from ..codec import decode_holder
from ..storage.base import Storage
from .reclaim_scan import HolderJudge, ReclaimDiscovery, discover_reclaim_candidates

__all__ = ["Discovery", "EngineDiscovery", "ScanDiscovery", "expiry_judge"]


@dataclass(slots=True)
class EngineDiscovery(ReclaimDiscovery):
    """A :class:`~.reclaim_scan.ReclaimDiscovery` plus what the engine records told.

    :param dead_engines: engines seen crashed or closed: their holders may be taken over before
        they expire.
    :param urgent: candidates of dead engines that an earlier pass already listed: taken now,
        whatever the fair share (the others had their turn).
    :param dead_left: some dead engine still has claims this pass did not list.
    """

    dead_engines: frozenset[str] = frozenset()
    urgent: set[str] = field(default_factory=set)
    dead_left: bool = False


class Discovery(Protocol):
    """How a reclaim target finds its candidates."""

    def discover(self, exclude: Collection[str]) -> EngineDiscovery:
        """Find the candidates, leaving out ``exclude`` (this engine's own claims)."""
        ...


class ScanDiscovery:
    """The full scans of :mod:`.reclaim_scan`: cost proportional to the whole store.

    Kept as the fallback discovery (``OwnershipOptions(reclaim_discovery="scan")``).
    """

    def __init__(self, storage: Storage, judge: HolderJudge, *, skip_live: bool) -> None:
        self._storage = storage
        self._judge = judge
        self._skip_live = skip_live

    def discover(self, exclude: Collection[str]) -> EngineDiscovery:
        found = discover_reclaim_candidates(
            self._storage, exclude, judge=self._judge, skip_live=self._skip_live
        )
        return EngineDiscovery(found.candidates, found.stranded, found.live_claims)


def expiry_judge(clock: Callable[[], int], renew_interval_ms: int) -> HolderJudge:
    """A judge naming a holder's engine while it is unexpired on ``clock``, else ``None``.

    An undecodable holder is never live: a takeover may replace it at once.
    """

    def judge(holder_bytes: bytes) -> str | None:
        holder = decode_holder(holder_bytes)
        if holder is None:
            return None
        expired = is_claim_expired(
            expires_at=holder.expires_at, now=clock(), renew_interval_ms=renew_interval_ms
        )
        return None if expired else holder.engine_id

    return judge
