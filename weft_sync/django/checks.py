"""System checks of ``settings.WEFT_SYNC`` (``manage.py check``; ids ``weft_sync.E001`` …).

- E001: the setting is missing, not a dict, or has an unknown key or a bad ``BACKGROUND``;
- E002: not exactly one of ``URL`` and ``DATABASE``, or the URL is not a storage URL;
- E003: ``DATABASE`` names no alias of ``settings.DATABASES``;
- E004: that database's engine (or an in-memory SQLite) cannot hold shared claims;
- E005: ``OPTIONS`` is not valid ``OwnershipOptions`` (unknown key, TTL rules);
- E006: ``HANDLERS`` is malformed or a handler path does not import;
- E007: a handler path names something that is not callable.

The checks read settings and import handler modules; they never open the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.checks import CheckMessage, Error

from .conf import find_problems


def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Report every problem of ``settings.WEFT_SYNC`` as an ``Error``."""
    return [
        Error(problem.message, hint=problem.hint, id=problem.check_id)
        for problem in find_problems()
    ]
