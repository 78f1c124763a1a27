"""Which discovered candidates one reclaim pass attempts: the fair share, within ``max_claims``.

:class:`CandidateSelection` is the reclaim target's selection state: when this engine first saw
each stranded candidate (a candidate left over by its fair-share taker for
:data:`~.fair_share.FAIR_SHARE_WINDOW_INTERVALS` renew intervals, or a dead engine's for
:data:`~.engine_discovery.DEAD_SHARE_WINDOW_MS`, is taken by anyone), which candidates the last
check found ineligible (left out of the share they would otherwise use up), and which engines
the last discovery saw crashed or closed. The rendezvous split of a dead engine's claims is made
here, before any holder is read, so survivors attempt disjoint shares.

The object has one lock, guarding that state; discovery, storage reads and logging run outside
it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from ..claims.registry import ClaimRegistry
from .discoveries import Discovery, EngineDiscovery
from .engine_discovery import DEAD_SHARE_WINDOW_MS
from .fair_share import FAIR_SHARE_WINDOW_INTERVALS, assigned_to, select_takeovers

# Logs under the reclaim target's logger: one logger names every step of a reclaim pass.
_log = logging.getLogger("weft_sync.reclaim.target")


class CandidateSelection:
    """The candidates of one pass, in the order to attempt them; see the module docstring.

    :param registry: this engine's claim registry (its clock, renew interval, held claims).
    :param discovery: how candidates are found.
    :param fair_share: attempt only this engine's fair share of the stranded candidates.
    :param max_claims: never take over beyond this many held claims (``None``: no limit).
    """

    def __init__(
        self,
        registry: ClaimRegistry,
        discovery: Discovery,
        *,
        fair_share: bool,
        max_claims: int | None,
    ) -> None:
        self._registry = registry
        self._discovery = discovery
        self._fair_share = fair_share
        self._max_claims = max_claims
        # _lock guards _first_seen, _ineligible, _dead_engines and _dead_left.
        self._lock = threading.Lock()
        # Stranded candidate -> when this engine first saw it stranded (its clock, ms).
        self._first_seen: dict[str, int] = {}
        # Candidates whose record the last check found ineligible: still attempted every pass
        # (a handler may be added), but left out of the fair share they would otherwise use up.
        self._ineligible: set[str] = set()
        # Engines the last discovery saw crashed or closed (with the record bytes judged), and
        # whether they kept claims this engine may still take.
        self._dead_engines: dict[str, bytes] = {}
        self._dead_left = False

    def select(self, held: list[str]) -> list[str]:
        """Discovery limited to this pass's takeovers: the fair share, within ``max_claims``.

        :param held: the claims this engine holds now (left out by discovery).
        """
        discovery = self._discovery.discover(held)
        now = self._registry.clock()
        window = FAIR_SHARE_WINDOW_INTERVALS * self._registry.claim_renew_interval_ms
        room = self.capacity_left() != 0
        with self._lock:
            self._ineligible.intersection_update(discovery.stranded)
            known_ineligible = [wid for wid in discovery.stranded if wid in self._ineligible]
            shared = [wid for wid in discovery.stranded if wid not in self._ineligible]
            seen = {wid: self._first_seen.get(wid, now) for wid in shared}
            self._first_seen = seen
            self._dead_engines = discovery.dead_records
            # Another urgent round is worth it only for dead claims this engine may still take:
            # not known ineligible here, and room left under max_claims.
            takeable = any(wid not in self._ineligible for wid in discovery.dead_claims)
            self._dead_left = room and (discovery.dead_left or takeable)
        dead = set(discovery.dead_claims)
        if self._fair_share:
            overdue = {wid for wid, first in seen.items() if now - first >= window}
            overdue |= discovery.urgent.intersection(seen)
            # Whatever the discovery: a dead engine's claim waits for its rendezvous taker
            # only for the dead-share window.
            overdue.update(
                wid
                for wid in discovery.dead_claims
                if wid in seen and now - seen[wid] >= DEAD_SHARE_WINDOW_MS
            )
        else:
            overdue = set(shared)
        mine = self._dead_share(discovery, set(shared), overdue)
        chosen = mine + select_takeovers(
            engine_id=self._registry.engine_id,
            stranded=[wid for wid in shared if wid not in dead],
            overdue=overdue,
            held=len(held) + len(mine),
            live_claims=discovery.live_claims,
            max_claims=self._max_claims,
        )
        if discovery.stranded:
            _log.debug(
                "reclaim pass takes %d of %d stranded workflows (%d overdue, %d ineligible "
                "before, %d other engines)",
                len(chosen),
                len(shared),
                len(overdue),
                len(known_ineligible),
                len(discovery.live_claims),
            )
        stranded = set(discovery.stranded)
        rest = [wid for wid in discovery.candidates if wid not in stranded]
        return chosen + known_ineligible + rest

    def _dead_share(
        self, discovery: EngineDiscovery, shared: set[str], overdue: set[str]
    ) -> list[str]:
        """Dead engines' claims this engine takes: its rendezvous share, and the overdue ones."""
        ids = [wid for wid in discovery.dead_claims if wid in shared]
        if not self._fair_share:
            mine = ids
        else:
            assigned = set(assigned_to(self._registry.engine_id, discovery.participants, ids))
            mine = [wid for wid in ids if wid in assigned or wid in overdue]
        capacity = self.capacity_left()
        return mine if capacity is None else mine[:capacity]

    def note_eligibility(self, workflow_id: str, eligible: bool) -> None:
        """Remember the last eligibility check of a candidate (only the limited selection
        reads it, and prunes it every pass)."""
        if not self._fair_share and self._max_claims is None:
            return
        with self._lock:
            if eligible:
                self._ineligible.discard(workflow_id)
            else:
                self._ineligible.add(workflow_id)

    def dead_engines(self) -> Mapping[str, bytes]:
        """Engines the last discovery saw crashed or closed, each with the bytes of the record
        it was judged on (see :attr:`~.discoveries.EngineDiscovery.dead_records`)."""
        with self._lock:
            return self._dead_engines

    def dead_work_left(self) -> bool:
        """Whether the last discovery saw claims of crashed or closed engines."""
        with self._lock:
            return self._dead_left

    def capacity_left(self) -> int | None:
        """How many more claims ``max_claims`` allows now; ``None`` without a limit."""
        if self._max_claims is None:
            return None
        return max(0, self._max_claims - len(self._registry.list_held_workflow_ids()))
