"""``weft_sync.django``: weft_sync as a reusable Django app.

Add ``"weft_sync.django"`` to ``INSTALLED_APPS`` and describe the store in ``settings.WEFT_SYNC``::

    WEFT_SYNC = {
        "DATABASE": "default",                 # or "URL": "postgresql://…" / "sqlite:///…"
        "OPTIONS": {"claim_ttl": "30s", "claim_renew_interval": "5s"},
        "HANDLERS": {"report": "reports.jobs.resume_report"},
    }

:func:`get_ownership` returns this process's :class:`~weft_sync.Ownership`, opened on first use
(after a fork, the child opens its own) and closed when the process exits;
:func:`fenced_atomic` is ``transaction.atomic`` that also holds a workflow's epoch fence, so
model writes of a deposed process are refused. The app also brings
system checks (``weft_sync.E001`` …), ``manage.py weft_sync <command>`` and a read-only admin.
"""

from __future__ import annotations

try:
    import django  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('weft_sync.django needs Django: pip install "weft_sync[django]"') from exc

from .fence import fenced_atomic
from .runtime import close_ownership, get_ownership

__all__ = ["close_ownership", "fenced_atomic", "get_ownership"]
