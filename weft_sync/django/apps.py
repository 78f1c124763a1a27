"""The ``AppConfig`` of ``weft_sync.django``: registers checks and receivers, opens nothing."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.core.signals import request_started, setting_changed

_log = logging.getLogger(__name__)


class WeftSyncConfig(AppConfig):
    """``INSTALLED_APPS += ["weft_sync.django"]``."""

    name = "weft_sync.django"
    label = "weft_sync"
    verbose_name = "Workflow ownership"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        """Register the system checks and the receivers; the store is not touched here."""
        from .checks import check_settings

        checks.register(check_settings, "weft_sync")
        request_started.connect(_open_on_request, dispatch_uid="weft_sync.open_on_request")
        setting_changed.connect(_reopen_on_change, dispatch_uid="weft_sync.setting_changed")


def _open_on_request(sender: Any, **kwargs: Any) -> None:
    """Open this worker's ``Ownership`` with its first request, so it starts reclaiming."""
    from .runtime import get_ownership, is_open

    if is_open():
        return
    raw = getattr(settings, "WEFT_SYNC", None)
    if not isinstance(raw, dict) or not raw.get("OPEN_ON_REQUEST", True):
        return
    try:
        get_ownership()
    except Exception:
        # The request itself may not need the store; the next one tries again.
        _log.exception("could not open the weft_sync ownership of this process")


def _reopen_on_change(sender: Any, setting: str, **kwargs: Any) -> None:
    if setting in ("WEFT_SYNC", "DATABASES"):
        from .runtime import close_ownership

        close_ownership()
