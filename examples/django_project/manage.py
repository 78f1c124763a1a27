#!/usr/bin/env python
"""Django's command-line utility for the example project (``weftsite`` + the ``reports`` app).

cd examples/django_project
python manage.py migrate                          # creates db.sqlite3 (the claims live there too)
python manage.py runserver                        # http://127.0.0.1:8000/jobs/
gunicorn -w 4 weftsite.wsgi                       # the same under gunicorn (gunicorn.conf.py)
curl -X POST localhost:8000/jobs/ -d pages=5      # -> {"id": "...", "status": "running"}
curl localhost:8000/jobs/<id>/                    # -> status, pages done, who completed it
python manage.py weft_sync claims                 # any weft-sync command, on this project's store
python manage.py weft_sync maintain --once --handler reports.jobs:resume_report --type report
python manage.py check                            # includes the weft_sync.E… checks

PostgreSQL instead of SQLite: WEFTSITE_DATABASE_URL=postgresql://user:pass@host/db (both the
reports and the claims then live in that database). WEFTSITE_CLAIM_TTL, WEFTSITE_RENEW_INTERVAL
and WEFTSITE_STEP_SECONDS tune the claim timing and the length of one report page.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "weftsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
