"""Django settings of the integration tests: one database, from ``WEFT_TEST_DJANGO_DB``.

``WEFT_TEST_DJANGO_DB`` is a path (SQLite) or a ``postgresql://`` URL (a database of the test's
own). The claims live in that database (``WEFT_SYNC["DATABASE"]``); maintenance is manual, so
tests drive every pass themselves.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

_DB = os.environ["WEFT_TEST_DJANGO_DB"]


def _database(spec: str) -> dict[str, Any]:
    if not spec.startswith("postgresql://"):
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": spec,
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
        }
    parts = urlsplit(spec)
    query = dict(parse_qsl(parts.query))
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.pop("host", parts.hostname or ""),
        "PORT": query.pop("port", str(parts.port or "")),
        "OPTIONS": query,
    }


SECRET_KEY = "tests-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "weft_sync.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.django_app.site_urls"
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
DATABASES = {"default": _database(_DB)}
WEFT_SYNC = {
    "DATABASE": "default",
    "OPTIONS": {"claim_ttl": "3s", "claim_renew_interval": "1s"},
    "HANDLERS": {"report": "tests.django_app.site_handlers.finish_report"},
    "BACKGROUND": "manual",
    "OPEN_ON_REQUEST": False,
    "STORAGE": {"max_size": 4} if _DB.startswith("postgresql://") else {},
}
