"""Settings of the example project: a real database, the admin, weft_sync and the reports app.

The database is SQLite (``db.sqlite3`` here, or ``WEFTSITE_SQLITE_PATH``) unless
``WEFTSITE_DATABASE_URL`` names a PostgreSQL one; the weft_sync claims live in the same database
(``WEFT_SYNC["DATABASE"]``), next to the reports they drive.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("WEFTSITE_SECRET_KEY", "example-project-not-a-secret")
DEBUG = os.environ.get("WEFTSITE_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "weft_sync.django",
    "reports",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "weftsite.urls"
WSGI_APPLICATION = "weftsite.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _postgres(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.pop("host", parts.hostname or ""),
        "PORT": query.pop("port", str(parts.port or "")),
        "OPTIONS": query,
        # Keep a worker's connection across requests instead of reconnecting for each one.
        "CONN_MAX_AGE": 60,
    }


def _sqlite(path: str) -> dict[str, Any]:
    # IMMEDIATE: a write transaction takes the lock up front, so concurrent writers wait for it
    # (up to the timeout) instead of failing with "database is locked" on upgrade.
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }


_DATABASE_URL = os.environ.get("WEFTSITE_DATABASE_URL", "")
DATABASES = {
    "default": _postgres(_DATABASE_URL)
    if _DATABASE_URL
    else _sqlite(os.environ.get("WEFTSITE_SQLITE_PATH", str(BASE_DIR / "db.sqlite3")))
}

REPORT_THREADS = int(os.environ.get("WEFTSITE_REPORT_THREADS", "8"))
"""Report jobs one process drives at once (more wait in its queue, already claimed)."""
# A reclaimed report runs whole on a handler thread, so this bounds how many taken-over reports
# one worker runs at once. With the library's default of 4, a worker that took over a crashed
# worker's reports while still running the reports of an earlier crash queues them (held and
# renewed, not driven) for up to a report's length; 32 lets it start them all at once.
HANDLER_WORKERS = int(os.environ.get("WEFTSITE_HANDLER_WORKERS", "32"))

WEFT_SYNC = {
    "DATABASE": "default",
    "OPTIONS": {
        "claim_ttl": os.environ.get("WEFTSITE_CLAIM_TTL", "30s"),
        "claim_renew_interval": os.environ.get("WEFTSITE_RENEW_INTERVAL", "5s"),
        "handler_workers": HANDLER_WORKERS,
    },
    # Reclaimed "report" workflows are resumed by this function; no other type is taken over.
    "HANDLERS": {"report": "reports.jobs.resume_report"},
    # The store's pool on PostgreSQL, sized from the threads that use it at once: every report
    # thread (checkpoints), every handler thread and the maintenance passes (renewal is
    # batched; reclaim and polls take a few more). The pool opens connections as they are
    # needed, up to this.
    "STORAGE": {"max_size": REPORT_THREADS + HANDLER_WORKERS + 4} if _DATABASE_URL else {},
}

REPORT_STEP_SECONDS = float(os.environ.get("WEFTSITE_STEP_SECONDS", "0.5"))
"""How long rendering one page of a report takes."""

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"weft_sync": {"handlers": ["console"], "level": "WARNING"}},
}
