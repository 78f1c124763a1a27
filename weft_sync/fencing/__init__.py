"""Host-data fencing: the host's own SQL and the epoch check in one database transaction.

Reached through :meth:`weft_sync.Ownership.fenced` (and ``weft_sync.django.fenced_atomic``).
:mod:`.core` holds the algorithm and the reasoning about locks; :mod:`.base` the small protocol
each connection family implements (:mod:`.sqlite3`, :mod:`.psycopg`, :mod:`.psycopg2`,
:mod:`.sqlalchemy`; Django's is :mod:`weft_sync.django.fence`).
"""
