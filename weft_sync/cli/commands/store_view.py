"""The store-wide view: ``status`` (a table or JSON) and ``metrics`` (Prometheus gauges).

Both read the store read-only and bootstrap no engine, so they take nothing over and count
nothing of their own: what they show is the fleet's state as the store records it — claims per
holder engine, live versus expired-but-not-yet-reclaimed claims, the oldest expiry, and running
workflows that no engine holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Final, TextIO

from ... import keys
from ...clock import system_clock
from ...storage import Storage
from .listing import read_claims
from .output import StoreRef, emit_json, emit_table, human_time
from .rows import read_values, scan_rows

_SHOWN_IDS: Final = 10
"""Running workflows without a holder named in the text view (all of them in JSON)."""


@dataclass(frozen=True)
class StoreView:
    """The claims and running workflows of one store at ``now`` (ms)."""

    now: int
    live: Counter[str]
    expired: Counter[str]
    undecodable: int
    oldest_expires_at: int | None
    running: int
    running_without_holder: list[str]

    @property
    def engines(self) -> list[str]:
        return sorted(set(self.live) | set(self.expired))

    def as_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "claims": {
                "total": sum(self.live.values()) + sum(self.expired.values()) + self.undecodable,
                "live": sum(self.live.values()),
                "expired": sum(self.expired.values()),
                "undecodable": self.undecodable,
            },
            "engines": {
                e: {"live": self.live[e], "expired": self.expired[e]} for e in self.engines
            },
            "oldest_expires_at": self.oldest_expires_at,
            "running": self.running,
            "running_without_holder": self.running_without_holder,
        }


def read_store_view(storage: Storage) -> StoreView:
    """Scan the holder records and the running index; the time is read after the scans."""
    claims = read_claims(storage)
    index = keys.workflow_status_index("running", "")
    running = []
    for key, _ in scan_rows(storage, index):  # an index entry's value is never read
        workflow_id = keys.try_decode_key_component(key[len(index) :])
        if workflow_id is not None:
            running.append(workflow_id)
    # A holder row that cannot be read is still a holder: the claims count it as undecodable.
    holders = read_values(storage, [keys.workflow_owner_holder(w) for w in running])
    now = system_clock()
    live: Counter[str] = Counter()
    expired: Counter[str] = Counter()
    for row in claims:
        if row.holder is not None:
            (live if row.is_live(now) else expired)[row.holder.engine_id] += 1
    expiries = [row.holder.expires_at for row in claims if row.holder is not None]
    return StoreView(
        now=now,
        live=live,
        expired=expired,
        undecodable=sum(1 for row in claims if row.holder is None),
        oldest_expires_at=min(expiries) if expiries else None,
        running=len(running),
        running_without_holder=[w for w, h in zip(running, holders, strict=True) if h is None],
    )


def status(store: StoreRef, as_json: bool, out: TextIO) -> int:
    """Print the store-wide view as a summary and a table per engine, or as JSON."""
    with store.open(read_only=True) as storage:
        view = read_store_view(storage)
    if as_json:
        emit_json(view.as_dict(), out)
        return 0
    counts = view.as_dict()["claims"]
    orphans = view.running_without_holder
    named = ", ".join(orphans[:_SHOWN_IDS]) + (", ..." if len(orphans) > _SHOWN_IDS else "")
    out.write(f"store                   {store.shown}\n")
    out.write(
        f"claims                  {counts['total']} ({counts['live']} live, "
        f"{counts['expired']} expired, {counts['undecodable']} undecodable)\n"
    )
    out.write(f"oldest expiry           {human_time(view.oldest_expires_at, view.now)}\n")
    out.write(f"running workflows       {view.running}\n")
    out.write(f"running, no holder      {len(orphans)}{f' ({named})' if orphans else ''}\n")
    if view.engines:
        out.write("\n")
        rows = [[e, str(view.live[e]), str(view.expired[e])] for e in view.engines]
        emit_table(["ENGINE", "LIVE", "EXPIRED"], rows, out)
    return 0


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics(store: StoreRef, out: TextIO) -> int:
    """Print the store-wide view as Prometheus gauges: engine ids are labels, workflow ids never."""
    with store.open(read_only=True) as storage:
        view = read_store_view(storage)
    lines = [
        "# HELP weft_store_claims Claims recorded in the store, by holder engine and state",
        "# TYPE weft_store_claims gauge",
    ]
    for engine in view.engines:
        for state, counts in (("live", view.live), ("expired", view.expired)):
            lines.append(
                f'weft_store_claims{{engine="{_label(engine)}",state="{state}"}} {counts[engine]}'
            )
    oldest_age = 0.0
    if view.oldest_expires_at is not None and view.oldest_expires_at < view.now:
        oldest_age = (view.now - view.oldest_expires_at) / 1000
    lines += [
        "# HELP weft_store_claims_undecodable Holder records in the store that do not decode",
        "# TYPE weft_store_claims_undecodable gauge",
        f"weft_store_claims_undecodable {view.undecodable}",
        "# HELP weft_store_expired_claims Claims past their expiry, not yet taken over",
        "# TYPE weft_store_expired_claims gauge",
        f"weft_store_expired_claims {sum(view.expired.values())}",
        "# HELP weft_store_oldest_expired_claim_age_seconds How long ago the oldest expired "
        "claim expired (0 when none has)",
        "# TYPE weft_store_oldest_expired_claim_age_seconds gauge",
        f"weft_store_oldest_expired_claim_age_seconds {oldest_age:.3f}",
        "# HELP weft_store_running_workflows Workflow records in status running",
        "# TYPE weft_store_running_workflows gauge",
        f"weft_store_running_workflows {view.running}",
        "# HELP weft_store_running_workflows_without_holder Running workflows no engine holds",
        "# TYPE weft_store_running_workflows_without_holder gauge",
        f"weft_store_running_workflows_without_holder {len(view.running_without_holder)}",
    ]
    out.write("\n".join(lines) + "\n")
    return 0
