"""gunicorn settings of the example project, read by ``gunicorn weftsite.wsgi`` run from here.

Each worker opens its own weft_sync ``Ownership`` as soon as it has booted, so that it renews
its claims and takes over a dead worker's reports even before it serves a request. Nothing is
opened in the master, with or without ``--preload``.
"""

from __future__ import annotations

from typing import Any

bind = "127.0.0.1:8000"


def post_worker_init(worker: Any) -> None:
    from weft_sync.django import get_ownership

    get_ownership()
