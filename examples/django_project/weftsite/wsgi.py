"""WSGI entry point: ``gunicorn -w 4 weftsite.wsgi`` (run from ``examples/django_project``)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "weftsite.settings")

# Opens no store: each process opens its own weft_sync Ownership on first use.
application = get_wsgi_application()
