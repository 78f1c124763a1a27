"""Host-data fencing: the host's own SQL and the epoch check in one database transaction.

Reached through :meth:`weft_sync.Ownership.fenced` (and ``weft_sync.django.fenced_atomic``).
:mod:`.core` holds the algorithm and the reasoning about locks; :mod:`.base` the small protocol
each connection family implements (:mod:`.sqlite3`, :mod:`.psycopg`, :mod:`.psycopg2`,
:mod:`.sqlalchemy`, :mod:`.django`).
"""

from __future__ import annotations

from .adapters import ACCEPTED as ACCEPTED
from .adapters import adapt as adapt
from .base import HostTransaction as HostTransaction
from .core import HostFence as HostFence
from .core import fenced_transaction as fenced_transaction

