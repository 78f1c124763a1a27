"""What one takeover attempt of the reclaim target reports, and how many CAS tries it makes.

The reclaim target (:mod:`weft_sync.reclaim.target`) produces these; the renewal task's reclaim
sub-pass (:mod:`weft_sync.maintenance`) counts them, so they sit on the reclaim floor.
"""

from __future__ import annotations

import enum
from typing import Final

TAKEOVER_MAX_ATTEMPTS: Final = 5
"""CAS attempts one reclaim attempt makes before it reports ``lost-race`` (inclusive bound)."""


class ReclaimAttemptResult(str, enum.Enum):
    """What one takeover attempt of a reclaim target achieved."""

    RECLAIMED = "reclaimed"
    NOT_ELIGIBLE = "not-eligible"
    BACKOFF_SKIPPED = "backoff-skipped"
    LOST_RACE = "lost-race"
